"""SIGTERM to a worker: with room on the others it hands its streams over and exits while they go on elsewhere
(DRAIN_MODE=auto); without room, or with DRAIN_MODE=finish, it finishes them first. ENGINE=sim workers, so the
times are the control plane's; tests/test_faults.py checks the texts on the real model."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
import redis

from common.keys import Keys
from tests.conftest import dispatched_to, pid_of, sim_stack, wait_for, workers_of
from tests.sse import Reading, Streamed, read_in_background
from worker.sim import VOCAB, sim_token

STREAMS = 8
TOKENS = 60
KEYS = Keys("llmserve")
SETTINGS = {"SIM_STEP_MS": "50"}


@dataclass
class Drained:
    worker_id: str  # the worker that was sent SIGTERM
    other: str
    held: set[str]  # the request ids it ran then
    exit_s: float  # from SIGTERM to its exit
    streams: list[Streamed]
    workers: dict[str, list[str]]  # each stream's workers, in the order it was dispatched to them
    finished_on: dict[str, list[str]]  # the worker each stream finished on


def start_streams(url: str, count: int) -> Reading:
    return read_in_background(url, [{"prompt": "one two", "max_tokens": TOKENS}] * count)


def drain_one(mode: str) -> Drained:
    """Start the streams on two workers, SIGTERM the busier once each of its streams has a few tokens out."""
    with sim_stack(2, **SETTINGS, DRAIN_MODE=mode) as running:
        r = redis.Redis.from_url(running.redis_url)
        reading = start_streams(running.url, STREAMS)
        streams = reading.streams

        def all_running() -> dict[str, set[str]] | None:
            held = {w.decode(): {rid.decode() for rid in r.hkeys(KEYS.assigned(w.decode()))}
                    for w in r.smembers(KEYS.workers)}
            return held if len(held) == 2 and sum(map(len, held.values())) == STREAMS else None

        held = wait_for(all_running, 30, "every stream running on the two workers", 0.05)
        worker_id = max(held, key=lambda w: len(held[w]))
        [other] = set(held) - {worker_id}
        wait_for(lambda: all(r.llen(KEYS.progress(rid)) >= 3 for rid in held[worker_id]), 30,
                 "a few tokens of each of its streams", 0.05)
        process = next(p for _, p in running.stack.processes if p.pid == pid_of(worker_id))
        sent = time.monotonic()
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(60) == 0
        exited = time.monotonic()
        reading.join(120)
        workers = {got.request_id: dispatched_to(running.url, got.request_id) for got in streams}
        finished_on = {got.request_id: workers_of(running.url, got.request_id, "finished") for got in streams}
        return Drained(worker_id, other, held[worker_id], exited - sent, streams, workers, finished_on)


@pytest.fixture(scope="module")
def drained() -> dict[str, Drained]:
    return {mode: drain_one(mode) for mode in ("auto", "finish")}


@pytest.mark.parametrize("mode", ["auto", "finish"])
def test_a_drained_workers_streams_end_whole(drained: dict[str, Drained], mode: str) -> None:
    run = drained[mode]
    print(f"DRAIN_MODE={mode}: worker exited {run.exit_s:.2f} s after SIGTERM with {STREAMS} streams on 2 workers")
    expected = "".join(VOCAB[sim_token(2 + i)] for i in range(TOKENS))
    assert len(run.streams) == STREAMS
    for got in run.streams:
        assert got.indexes == list(range(TOKENS)) and got.text == expected
        assert got.final["completion_tokens"] == TOKENS
    assert run.held


def test_auto_hands_the_streams_to_the_other_worker_which_finishes_them(drained: dict[str, Drained]) -> None:
    run = drained["auto"]
    for got in run.streams:
        moved = got.request_id in run.held
        assert run.workers[got.request_id] == ([run.worker_id, run.other] if moved else [run.other])
        assert run.finished_on[got.request_id] == [run.other]


def test_finish_keeps_the_streams_on_their_worker_until_they_end(drained: dict[str, Drained]) -> None:
    run = drained["finish"]
    for got in run.streams:
        stayed = run.worker_id if got.request_id in run.held else run.other
        assert run.workers[got.request_id] == run.finished_on[got.request_id] == [stayed]
    # Handing over is the quicker way out: auto leaves before finish would have.
    assert drained["auto"].exit_s < run.exit_s


def test_with_no_room_elsewhere_a_worker_finishes_what_it_runs() -> None:
    with sim_stack(1, **SETTINGS) as running:
        reading = start_streams(running.url, 2)
        wait_for(lambda: httpx.get(f"{running.url}/health").json()["running"] == 2, 10, "both running", 0.1)
        [(_, worker)] = [(n, p) for n, p in running.stack.processes if n == "worker"]
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(30) == 0
        reading.join(30)
        assert [len(got.indexes) for got in reading.streams] == [TOKENS, TOKENS]
        assert all(len(dispatched_to(running.url, got.request_id)) == 1 for got in reading.streams)  # none moved
