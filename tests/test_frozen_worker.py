"""A worker frozen past WORKER_TTL (SIGSTOP: a paused VM, a swap storm) is taken for lost and its streams move to
another worker. When it wakes it must not go on with them: each request is finished once, by the worker it moved
to, and every stream is whole. Found by the nemesis soak (bench/nemesis.py), where a woken worker finished its
old requests a second time."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from common.clients import sync_client
from common.keys import Keys
from common.protocol import Heartbeat, decode
from harness.stacks import PrivateStack
from tests.conftest import pid_of, sim_stack, wait_for, workers_of
from tests.sse import Reading, read_in_background
from worker.ownership import sort_out

TOKENS = 300


@contextmanager
def streaming(namespace: str, streams: int) -> Iterator[tuple[PrivateStack, redis.Redis, Keys, Reading, str]]:
    """A sim stack of one worker (WORKER_TTL 2 s) with `streams` long streams under way: the stack, its Redis, its
    keys, the streams being read, and the worker's id."""
    with sim_stack(1, NAMESPACE=namespace, SIM_STEP_MS="20", SIM_STEP_PER_SEQ_MS="0", HEARTBEAT_INTERVAL="0.3",
                   WORKER_TTL="2", LOG_LEVEL="INFO") as stack:
        client, keys = sync_client(stack.redis_url), Keys(namespace)
        bodies = [{"prompt": f"{namespace} {i}", "max_tokens": TOKENS, "ignore_eos": True} for i in range(streams)]
        reading = read_in_background(stack.url, bodies)
        wait_for(lambda: all(len(s.events) > 20 for s in reading.streams), 60, "every stream under way")
        [worker] = [member.decode() for member in client.smembers(keys.workers)]
        yield stack, client, keys, reading, worker


def test_a_request_without_its_assignment_is_moved_unless_its_owner_still_names_this_worker() -> None:
    rids = ["kept", "moved", "ended", "taken", "old", "forgotten"]
    assignments = [b"submit", None, None, None, None, None]
    # "ended" and "moved": owner '' (the scheduler moved it, or it ended); "taken": another worker's; "old": no owner
    # key (a scheduler of before the fence); "forgotten": still this worker's.
    owners = [b"w1", b"", b"", b"w2", None, b"w1"]
    found = sort_out("w1", rids, assignments, owners)
    assert found.moved == {"moved", "ended", "taken", "old"} and found.forgotten == {"forgotten"}


def moved_away(metrics_port: int) -> float:
    """A worker's llmserve_worker_moved_away_total: the requests it dropped, unpublished, as moved away from it."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "llmserve_worker_moved_away_total")


def test_a_worker_that_wakes_after_its_streams_moved_publishes_none_of_them() -> None:
    with streaming("frozen", 4) as (stack, client, keys, reading, frozen):
        port = decode(client.get(keys.heartbeat(frozen)), Heartbeat, 1 << 20).metrics_port
        os.kill(pid_of(frozen), signal.SIGSTOP)
        stack.stack.spawn("worker")
        try:
            wait_for(lambda: frozen.encode() not in client.smembers(keys.workers), 30,
                     "the frozen worker taken as lost")
            wait_for(lambda: all(len(workers_of(stack.url, s.request_id)) == 2 for s in reading.streams), 30,
                     "every stream dispatched to the other worker")
        finally:
            os.kill(pid_of(frozen), signal.SIGCONT)
        reading.join(120)
        # The woken worker drops each of its old requests, and counts it, in the first step it would publish it
        # (found moved, or refused by its owner fence): its count at 4, every step it took of them is in Redis, the
        # trace stamps of any it ran to the end included, and none of them is left in its engine to publish later.
        wait_for(lambda: moved_away(port) >= len(reading.streams), 30, "the woken worker to drop its old requests")
        for stream in reading.streams:
            assert stream.ended == "done" and stream.indexes == list(range(TOKENS))
            finished_on = workers_of(stack.url, stream.request_id, "finished")
            assert len(finished_on) == 1 and finished_on[0] != frozen, finished_on
        assert frozen.encode() in client.smembers(keys.workers)  # it serves again, with nothing of the old


def test_a_worker_that_wakes_to_find_its_assignments_forgotten_ends_their_streams_with_an_error() -> None:
    """Redis forgot the worker's assignments while it stood still (a cluster node restarted without its data), and
    nobody moved its requests: their owner keys still name it. Without an end from it, those streams would stay open
    and a resume of them would wait for ever. Found by a cluster test whose resumes hung."""
    with streaming("forgotten", 3) as (_, client, keys, reading, worker):
        # The scheduler stands still too, so that nothing takes the worker for lost and moves its requests.
        stopped = [pid_of(client.get(keys.lease).decode()), pid_of(worker)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            client.delete(keys.assigned(worker))
            time.sleep(2.5)
            os.kill(pid_of(worker), signal.SIGCONT)
            reading.join(30)
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        for stream in reading.streams:
            assert stream.ended == "error" and stream.final["error"]["code"] == "redis_unavailable", stream.events[-1:]
            assert stream.indexes == list(range(len(stream.indexes))) and len(stream.indexes) < TOKENS
