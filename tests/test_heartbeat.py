"""A worker's heartbeats survive faults of the worker's own: an engine whose cache report fails still beats (the
report left out), and a heartbeat that fails for any reason, not only Redis, is logged and counted while the next
ones still go, so the scheduler never takes a serving worker for lost. On a real redis-server.

Each case runs in an interpreter of its own (this module run as a script): the worker's metrics share their names with
the scheduler's, which other tests of the session import, and one process holds each name once."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from common.clients import sync_client
from common.keys import Keys
from common.protocol import Heartbeat, decode
from common.settings import Settings
from llmserve.processes import wait_until
from tests.conftest import redis_server

ROOT = Path(__file__).resolve().parent.parent


class BrokenReport:
    """A cache report that fails, as vLLM's block pool read from another thread once could."""

    def remember(self, keys: list, prompt_ids: list[int]) -> None:
        pass

    def held(self) -> list[int]:
        raise RuntimeError("the block pool changed while it was read")


def errors(kind: str) -> float:
    from worker import metrics

    return metrics.HEARTBEAT_ERRORS.labels(kind)._value.get()


def worker(url: str):  # -> worker.main.Worker, imported in the case's own interpreter only
    from worker.main import Worker
    from worker.sim import SimEngine, SimModel

    model = SimModel()
    settings = Settings(redis_url=url, namespace="beats", heartbeat_interval=0.05)
    return Worker(settings, model, SimEngine(model, 4, 0, 0))


def alone(case: str) -> None:
    """Run `case` of this file in a fresh interpreter; its assertion failures fail the test."""
    done = subprocess.run([sys.executable, "-m", "tests.test_heartbeat", case], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_failing_cache_report_leaves_the_heartbeat_going_without_it() -> None:
    alone("cache_report")


def test_a_heartbeat_that_fails_for_any_reason_does_not_stop_the_next_ones() -> None:
    alone("any_fault")


def cache_report() -> None:
    with redis_server() as url:
        subject = worker(url)
        subject.engine.routing = BrokenReport()
        before = errors("internal")
        subject.heartbeats.send()
        beat = decode(sync_client(url).get(Keys("beats").heartbeat(subject.id)), Heartbeat, 1 << 20)
        assert beat.worker_id == subject.id and beat.prefixes == []
        assert errors("internal") == before + 1


def any_fault() -> None:
    with redis_server() as url:
        subject = worker(url)
        real, calls = subject.heartbeats.send, []

        def flaky() -> None:
            calls.append(1)
            if len(calls) <= 2:
                raise KeyError("a fault of the worker's own")
            real()

        subject.heartbeats.send = flaky
        before = errors("internal")
        beats = threading.Thread(target=subject.heartbeats.run, daemon=True)
        beats.start()
        key = Keys("beats").heartbeat(subject.id)
        try:
            wait_until(lambda: sync_client(url).exists(key), 10, "a heartbeat after two failures", 0.02)
        finally:
            subject.heartbeats.beating = False
            subject.heartbeats.soon()
            beats.join(5)
        assert errors("internal") == before + 2 and len(calls) >= 3


if __name__ == "__main__":
    {"cache_report": cache_report, "any_fault": any_fault}[sys.argv[1]]()
