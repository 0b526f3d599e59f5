"""SIGTERM to a worker: with room on the others it hands its streams over and exits within about a step
(DRAIN_MODE=auto); without room, or with DRAIN_MODE=finish, it finishes them first. ENGINE=sim workers,
so the times are the control plane's; tests/test_faults.py checks the texts on the real model."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import redis

from common.protocol import Keys
from llmserve.launcher import PrivateStack, private_stack
from llmserve.launcher import wait_until as wait_for
from tests.sse import events
from worker.sim import VOCAB, sim_token

STREAMS = 8
TOKENS = 60
SETTINGS = {"ENGINE": "sim", "SIM_STEP_MS": "50", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
            "LOG_LEVEL": "WARNING"}


def stream(url: str, out: list[tuple[list[int], str, dict]]) -> None:
    with httpx.Client(base_url=url, timeout=120) as client, client.stream(
            "POST", "/generate_stream", json={"prompt": "one two", "max_tokens": TOKENS}) as response:
        indexes, text, final = [], "", {}
        for event in events(response):
            if "index" in event.data:
                indexes.append(event.data["index"])
                text += event.data["token"]
            else:
                final = event.data
    out.append((indexes, text, final))


def busiest_worker(running: PrivateStack) -> int:
    r = redis.Redis.from_url(running.redis_url)
    keys = Keys("llmserve")
    held = {w.decode(): r.hlen(keys.assigned(w.decode())) for w in r.smembers(keys.workers)}
    worker_id = max(held, key=held.__getitem__)
    assert held[worker_id] > 0
    return int(worker_id.split("-")[-2])


def drain_one(mode: str) -> tuple[float, list[tuple[list[int], str, dict]]]:
    """Start the streams, SIGTERM the busiest worker once they run; returns its exit time and the streams."""
    with private_stack(2, **SETTINGS, DRAIN_MODE=mode) as running:
        results: list[tuple[list[int], str, dict]] = []
        threads = [threading.Thread(target=stream, args=(running.url, results)) for _ in range(STREAMS)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # every stream is running, about 20 tokens in
        pid = busiest_worker(running)
        process = next(p for _, p in running.stack.processes if p.pid == pid)
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        process.wait(60)
        exit_s = time.monotonic() - sent
        for thread in threads:
            thread.join(120)
        return exit_s, results


@pytest.mark.parametrize("mode", ["auto", "finish"])
def test_a_drained_workers_streams_end_whole(mode: str) -> None:
    exit_s, results = drain_one(mode)
    print(f"DRAIN_MODE={mode}: worker exited {exit_s:.2f} s after SIGTERM with {STREAMS} streams on 2 workers")
    expected = "".join(VOCAB[sim_token(2 + i)] for i in range(TOKENS))
    assert len(results) == STREAMS
    for indexes, text, final in results:
        assert indexes == list(range(TOKENS)) and text == expected and final["completion_tokens"] == TOKENS
    if mode == "auto":
        assert exit_s < 1.5  # about a step: it hands over rather than finishing ~40 more tokens (2 s)
    else:
        assert exit_s > 1.5


def test_with_no_room_elsewhere_a_worker_finishes_what_it_runs() -> None:
    with private_stack(1, **SETTINGS) as running:
        results: list[tuple[list[int], str, dict]] = []
        threads = [threading.Thread(target=stream, args=(running.url, results)) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_for(lambda: httpx.get(f"{running.url}/health").json()["running"] == 2, 10, "both running", 0.1)
        [(_, worker)] = [(n, p) for n, p in running.stack.processes if n == "worker"]
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(30) == 0
        for thread in threads:
            thread.join(30)
        assert [len(indexes) for indexes, _, _ in results] == [TOKENS, TOKENS]
