"""The workers' autoscaling, simulated on real processes: a small controller reads the signal the KEDA
ScaledObject reads (deploy/kubernetes/base/worker/worker-autoscaling.yaml: the request stream's length plus
the sequences running, from the gateway's /health) and starts and stops worker processes by the same
rule as KEDA and the HPA, on a faster clock. From zero on the first request, out under a burst, in
(SIGTERM: the worker drains) and back to zero when idle, with every stream whole."""

from __future__ import annotations

import math
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from common.keys import Keys
from common.settings import Settings
from harness.stacks import PrivateStack, pid_of
from llmserve.processes import wait_until
from tests.conftest import sim_stack
from tests.sse import Streamed, read

ROOT = Path(__file__).resolve().parent.parent
NS = "autoscale"
SLOTS = 4
SIM = {"NAMESPACE": NS, "WORKER_SLOTS": str(SLOTS), "SIM_STEP_MS": "30"}


def scaled_object() -> dict:
    path = ROOT / "deploy" / "kubernetes" / "base" / "worker" / "worker-autoscaling.yaml"
    docs = yaml.safe_load_all(path.read_text())
    return next(doc for doc in docs if doc["kind"] == "ScaledObject")["spec"]


@dataclass
class Controller:
    """KEDA and the HPA in miniature. Each step: demand = the formula over the two triggers; from zero
    to one worker as soon as demand passes activationTarget (KEDA), then ceil(demand / target) workers
    (the HPA's AverageValue), up at once, down to the highest recommendation of the stabilization
    window and one worker per period, to zero after the cooldown with no demand (KEDA)."""

    running: PrivateStack
    namespace: str
    target: float
    max_workers: int
    window_s: float = 2.0  # the ScaledObject's 120 s, 300 s and 60 s, sped up
    cooldown_s: float = 3.0
    period_s: float = 1.0
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # newest last
    stopped: list[subprocess.Popen[bytes]] = field(default_factory=list)
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    last_active: float = -math.inf
    last_down: float = -math.inf
    peak: int = 0
    stopped_busy: int = 0  # workers stopped while they held requests

    def __post_init__(self) -> None:
        spec = scaled_object()
        triggers = {t["name"]: t for t in spec["triggers"]}
        assert spec["advanced"]["scalingModifiers"]["formula"] == "waiting + running"
        assert triggers["waiting"]["metadata"]["stream"] == Keys("llmserve").requests
        self.stream = Keys(self.namespace).requests
        self.value_location = triggers["running"]["metadata"]["valueLocation"]
        self.activation = float(spec["advanced"]["scalingModifiers"]["activationTarget"])
        self.redis = redis.Redis.from_url(self.running.redis_url)

    def demand(self) -> int:
        waiting = self.redis.xlen(self.stream)
        running = httpx.get(f"{self.running.url}/health", timeout=5).json()[self.value_location]
        return waiting + running

    def step(self) -> None:
        now, demand, replicas = time.monotonic(), self.demand(), len(self.workers)
        active = demand > self.activation
        if active:
            self.last_active = now
        if replicas == 0:
            desired = 1 if active else 0
        elif not active and now - self.last_active >= self.cooldown_s:
            desired = 0
        else:
            recommendation = min(max(math.ceil(demand / self.target), 1), self.max_workers)
            self.recommendations.append((now, recommendation))
            while self.recommendations[0][0] < now - self.window_s:
                self.recommendations.popleft()
            desired = max(recommendation, min(replicas, max(r for _, r in self.recommendations)))
            if desired < replicas:
                desired = replicas if now - self.last_down < self.period_s else replicas - 1
        self.scale(desired)

    def held(self, worker: subprocess.Popen[bytes]) -> int:
        """The requests a worker process holds (worker ids are host-pid-suffix)."""
        keys = Keys(self.namespace)
        for member in self.redis.smembers(keys.workers):
            if pid_of(member) == worker.pid:
                return self.redis.hlen(keys.assigned(member.decode()))
        return 0

    def scale(self, desired: int) -> None:
        while len(self.workers) < desired:
            self.workers.append(self.running.stack.spawn("worker"))
        while len(self.workers) > desired:
            worker = self.workers.pop()  # the newest goes first, as a ReplicaSet picks
            self.stopped_busy += self.held(worker) > 0
            worker.send_signal(signal.SIGTERM)
            self.stopped.append(worker)
            self.last_down = time.monotonic()
        self.peak = max(self.peak, len(self.workers))

    def run_until(self, done: Callable[[], bool], timeout: float) -> None:
        """Steps from this (the main) thread: a worker ends with the thread that spawned it."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"not done within {timeout} s; {len(self.workers)} workers"
            self.step()
            time.sleep(0.25)


def stream(url: str, body: dict) -> Streamed:
    got = read(url, "/generate_stream", body=body, timeout=300)
    assert got.status == 200 and got.ended == "done", (got.body, got.final)
    return got


def whole(result: Streamed, tokens: int) -> bool:
    return result.indexes == list(range(tokens)) and result.final.get("completion_tokens") == tokens


@pytest.fixture
def autoscaled() -> Iterator[PrivateStack]:
    """No worker yet: the controller starts them."""
    with sim_stack(0, **SIM) as running:
        yield running


def test_sim_workers_scale_from_zero_out_under_a_burst_in_and_back_to_zero(autoscaled: PrivateStack) -> None:
    controller = Controller(autoscaled, NS, target=SLOTS, max_workers=4)
    body = {"prompt": "Tell me about ships", "max_tokens": 120}
    with ThreadPoolExecutor(32) as pool:
        first = pool.submit(stream, autoscaled.url, body)
        controller.run_until(first.done, 120)
        assert whole(first.result(), 120) and controller.peak == 1
        from_zero = first.result().first_token_s

        # The last few run longest: they hold workers while the demand falls and workers are stopped.
        lengths = [120] * 20 + [300] * 4
        burst = [pool.submit(stream, autoscaled.url, {**body, "max_tokens": n}) for n in lengths]
        controller.run_until(lambda: all(s.done() for s in burst), 240)
        assert controller.peak == 4, "24 requests of 4 slots each: as many workers as allowed"
        assert all(whole(s.result(), n) for s, n in zip(burst, lengths, strict=True)), \
            "a request was lost or cut while scaling"
        assert controller.stopped_busy, "no worker was stopped while requests ran: the drain went untested"

        controller.run_until(lambda: not controller.workers and all(w.poll() is not None for w in controller.stopped),
                             60)
    assert len(controller.stopped) == 4 and all(w.returncode == 0 for w in controller.stopped), \
        "every worker stopped by SIGTERM drained and exited cleanly"
    # The gateway caches the worker list for a second.
    wait_until(lambda: httpx.get(f"{autoscaled.url}/health").json()["workers"] == 0, 10, "no worker in /health")
    print(f"scale from zero (sim worker): first token {from_zero:.2f} s after the request; "
          f"burst of 24 served by up to {controller.peak} workers, {controller.stopped_busy} stopped while busy")


def test_a_real_model_worker_scales_from_zero_for_the_first_request() -> None:
    settings = {**SIM, "ENGINE": "hf", "MODEL": Settings().model, "NAMESPACE": "autoscale-hf", "WORKER_THREADS": "1"}
    with sim_stack(0, **settings) as running:
        controller = Controller(running, settings["NAMESPACE"], target=SLOTS, max_workers=1)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(stream, running.url, {"prompt": "The quick brown", "max_tokens": 8,
                                                              "ignore_eos": True})
            controller.run_until(first.done, 300)
        result = first.result()
        assert whole(result, 8) and controller.peak == 1
    print(f"scale from zero (real model): first token {result.first_token_s:.1f} s after the request")
