"""Supervision under `llmserve up`, on real processes and the real model: a worker killed by
kill -9 comes back while its streams finish on the other one, a killed embedded Redis comes
back, and nothing outlives a launcher killed by kill -9."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from common.keys import Keys
from llmserve.launcher import redis_reachable
from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for
from tests.conftest import pid_of
from tests.sse import Reading, read_in_background

NS = "supervise"
KEYS = Keys(NS)
TOKENS = 40
PROMPTS = [
    "Write a long essay about the history of ships.",
    "The quick brown",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Paris is",
    "def fibonacci(n):",
    "The three primary colours are red,",
    "In 1905 Albert Einstein published four papers that",
    "A recipe for bread: first,",
]


@dataclass
class Launcher:
    process: subprocess.Popen[bytes]
    url: str
    redis_url: str
    metrics_url: str
    log: Path

    def children(self, name: str) -> list[psutil.Process]:
        """The launcher's live processes of one service ("redis" for the embedded redis-server)."""
        found = []
        for child in psutil.Process(self.process.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                is_redis = child.name() == "redis-server"
                wanted = is_redis if name == "redis" else not is_redis and child.cmdline()[-1] == name
                if wanted and alive(child):
                    found.append(child)
        return found

    def restarts(self, service: str) -> float:
        for line in httpx.get(f"{self.metrics_url}/metrics").text.splitlines():
            if line.startswith(f'llmserve_launcher_restarts_total{{service="{service}"}}'):
                return float(line.split()[-1])
        return 0.0

    def log_lines(self, msg: str) -> list[dict]:
        """The JSON log lines of every process of the stack with this message."""
        found = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("msg") == msg:
                    found.append(record)
        return found


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def workers_serving(url: str) -> int:
    try:
        return httpx.get(f"{url}/health").json().get("workers", 0)
    except (httpx.HTTPError, ValueError):
        return 0


def stop(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a terminal sends it; everything killed if that does not end it in time."""
    if process.poll() is not None:
        return
    stragglers = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        for straggler in [*stragglers, psutil.Process(process.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                straggler.kill()
        process.wait()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """`llmserve up --workers 2` with an embedded Redis, every port free, fast heartbeats."""
    port, metrics_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    env = dict(os.environ, REDIS_URL=redis_url, NAMESPACE=NS, GATEWAY_HOST="127.0.0.1", GATEWAY_PORT=str(port),
               SCHEDULER_METRICS_PORT=str(free_port()), WORKER_METRICS_PORT=str(free_port()),
               LAUNCHER_METRICS_PORT=str(metrics_port), WORKER_THREADS="1", HEARTBEAT_INTERVAL="0.3",
               WORKER_TTL="2")
    log = tmp_path_factory.mktemp("launcher") / "stderr.log"
    llmserve = Path(sys.executable).with_name("llmserve")
    with log.open("wb") as stderr:
        process = subprocess.Popen([str(llmserve), "up", "--workers", "2"], env=env, stdout=subprocess.DEVNULL,
                                   stderr=stderr)
    running = Launcher(process, f"http://127.0.0.1:{port}", redis_url, f"http://127.0.0.1:{metrics_port}", log)
    try:
        wait_for(lambda: workers_serving(running.url) == 2, 300, "two workers behind llmserve up", 0.5)
        yield running
    finally:
        stop(process)


def start_streams(url: str) -> Reading:
    return read_in_background(url, [{"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
                                    for prompt in PROMPTS], timeout=300)


def assigned(r: redis.Redis) -> dict[str, set[str]]:
    """worker id -> the request ids it is running."""
    return {w.decode(): {rid.decode() for rid in r.hkeys(KEYS.assigned(w.decode()))} for w in r.smembers(KEYS.workers)}


def test_a_killed_worker_is_restarted_and_its_streams_end_normally(launcher: Launcher) -> None:
    reading = start_streams(launcher.url)
    reading.join(300)
    streams = reading.streams
    expected = [s.text for s in streams]
    r = redis.Redis.from_url(launcher.redis_url)
    workers_before = {p.pid for p in launcher.children("worker")}

    reading = start_streams(launcher.url)
    streams = reading.streams
    # Kill once every stream has tokens out, so that the killed worker's requests resume with them.
    wait_for(lambda: all(len(s.tokens) >= 4 for s in streams), 120, "every stream to deliver tokens", 0.02)
    victim, running = max(assigned(r).items(), key=lambda item: len(item[1]))
    assert running and pid_of(victim) in workers_before, "the victim must be the launcher's, running streams"
    os.kill(pid_of(victim), signal.SIGKILL)
    killed_at = time.monotonic()
    reading.join(300)

    for stream, text in zip(streams, expected, strict=True):
        assert all(e.event != "error" for e in stream.events)
        assert [t["index"] for t in stream.tokens] == list(range(TOKENS))
        assert stream.events[-1].data["finish_reason"] == "length"
        assert stream.events[-1].data["completion_tokens"] == TOKENS
        assert stream.text == text
    assert running <= {s.request_id for s in streams}

    def restarted_worker_serves() -> int | None:
        new = {p.pid for p in launcher.children("worker")} - workers_before
        live = {pid_of(w) for w in assigned(r)}
        return next(iter(new & live), None) if workers_serving(launcher.url) == 2 else None

    wait_for(restarted_worker_serves, 180, "the restarted worker to serve", 0.1)
    print(f"worker kill -9: restarted worker serving {time.monotonic() - killed_at:.1f} s after the kill")
    assert launcher.process.poll() is None
    assert launcher.restarts("worker") == 1
    crash = [line for line in launcher.log_lines("service exited; restarting") if line["service"] == "worker"]
    assert [(c["pid"], c["signal"], c["exit_code"]) for c in crash] == [(pid_of(victim), "SIGKILL", None)]
    assert crash[0]["restart_in_s"] > 0


def test_a_killed_embedded_redis_is_restarted_and_the_stack_serves_again(launcher: Launcher) -> None:
    (redis_server,) = launcher.children("redis")
    redis_server.kill()
    wait_for(lambda: redis_reachable(launcher.redis_url), 30, "the embedded redis to be restarted")
    config = redis.Redis.from_url(launcher.redis_url, decode_responses=True).config_get("maxmemory*")
    assert config["maxmemory"] == str(1 << 30) and config["maxmemory-policy"] == "noeviction"

    def serves() -> bool:
        try:
            body = {"prompt": "Hi", "max_tokens": 4}
            return httpx.post(f"{launcher.url}/generate", json=body, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(lambda: workers_serving(launcher.url) == 2 and serves(), 60, "the stack to serve again", 0.5)
    assert launcher.restarts("redis") == 1
    assert launcher.restarts("scheduler") == launcher.restarts("gateway") == 0  # they reconnected instead


def test_nothing_outlives_a_launcher_killed_by_kill_9(launcher: Launcher) -> None:
    """Last in this module: it ends the module's launcher."""
    services = psutil.Process(launcher.process.pid).children()
    assert {c.name() for c in services} >= {"redis-server"} and len(services) == 5
    # And theirs (the gateway's grammar sandbox, common/sandbox.py): nothing of the tree may outlive it.
    children = psutil.Process(launcher.process.pid).children(recursive=True)
    launcher.process.kill()
    launcher.process.wait()
    try:
        wait_for(lambda: not any(alive(c) for c in children), 10, "every service and redis to exit")
    finally:
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
