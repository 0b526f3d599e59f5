"""Chaos on real processes: kill -9 and SIGTERM workers, kill -9 the scheduler,
stop and start Redis, on a stack of its own (two workers, the real model)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import httpx
import pytest
import redis

from common.clients import sync_client
from common.keys import Keys
from common.protocol import Error, Result, SamplingParams, Submit, decode
from common.settings import Settings
from harness.stacks import PrivateStack, private_stack
from llmserve.launcher import Stack
from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for
from scheduler.main import Scheduler
from tests.conftest import dispatched_to, pid_of, responds, workers_of
from tests.sse import Streamed, read

NS = "chaos"
KEYS = Keys(NS)
SETTINGS = {"NAMESPACE": NS, "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2"}
LONG = {"prompt": "Write a long essay about the history of ships.", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}
# A fault at one of its first tokens (or a few polls after them) must land while it still runs: on a fast host
# LONG's 40 tokens were done before the client, a few events behind, got to its eighth.
LONGER = {**LONG, "max_tokens": 240}


@pytest.fixture(scope="module")
def chaos() -> Iterator[PrivateStack]:
    with private_stack(2, **SETTINGS) as running:
        yield running


def client_of(running: PrivateStack) -> redis.Redis:
    return sync_client(running.redis_url)


def worker_running(r: redis.Redis, request_id: str) -> str:
    for member in r.smembers(KEYS.workers):
        if r.hexists(KEYS.assigned(member.decode()), request_id):
            return member.decode()
    raise AssertionError(f"no worker holds {request_id}")


def restore_workers(running: PrivateStack, count: int = 2) -> None:
    """Replace dead workers so that the next test starts with `count` of them again (a real-model worker's start can
    take minutes on a loaded 2-core host)."""
    live = sum(1 for name, p in running.stack.processes if name == "worker" and p.poll() is None)
    for _ in range(count - live):
        running.stack.spawn("worker")
    wait_for(lambda: httpx.get(f"{running.url}/health").json().get("workers") == count, 300, "workers", 0.5)


def reference(running: PrivateStack, body: dict = LONG) -> str:
    return httpx.post(f"{running.url}/generate", json=body, timeout=120).json()["text"]


def stream_with_fault(running: PrivateStack, fault_at: int, fault, body: dict = LONG) -> tuple[Streamed, float]:
    """Stream `body`, call `fault(request_id)` once token `fault_at` arrived; returns the stream and the longest
    pause between its events after the fault (the next event alone may have been read already)."""
    faulted: list[float] = []

    def on_token(request_id: str, index: int) -> None:
        if index == fault_at:
            fault(request_id)
            faulted.append(time.monotonic())

    got = read(running.url, "/generate_stream", body=body, on_token=on_token)
    after = [faulted[0], *(at for at in got.arrived if at > faulted[0])] if faulted else []
    return got, max((b - a for a, b in pairwise(after)), default=0.0)


def test_a_killed_workers_stream_continues_on_another_without_loss_or_duplicate(chaos: PrivateStack) -> None:
    expected = reference(chaos, LONGER)
    r = client_of(chaos)  # made before the stream: a cluster client's first call maps the slots

    def kill(request_id: str) -> None:
        os.kill(pid_of(worker_running(r, request_id)), signal.SIGKILL)

    got, gap = stream_with_fault(chaos, 8, kill, LONGER)
    count = LONGER["max_tokens"]
    assert got.indexes == list(range(count))
    assert got.text == expected
    assert got.final["finish_reason"] == "length" and got.final["completion_tokens"] == count
    print(f"worker kill -9: the stream paused {gap:.2f} s at most after the fault")
    restore_workers(chaos)


def test_sigterm_hands_eight_greedy_streams_to_the_other_worker(chaos: PrivateStack) -> None:
    """DRAIN_MODE=auto with room on the other worker: the drained worker hands its streams over (each one's trace
    shows a second dispatch, to the other worker, which finishes it) and exits; every stream ends whole, its text
    equal to an unbroken run."""
    expected, count = reference(chaos, LONGER), LONGER["max_tokens"]
    r = client_of(chaos)
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream_with_fault, chaos, 10_000, lambda _rid: None, LONGER) for _ in range(8)]

        def busiest() -> str | None:
            held = {w.decode(): r.hlen(KEYS.assigned(w.decode())) for w in r.smembers(KEYS.workers)}
            return max(held, key=held.__getitem__) if len(held) == 2 and sum(held.values()) == 8 else None

        worker_id = wait_for(busiest, 60, "eight streams on two workers")
        [other] = {w.decode() for w in r.smembers(KEYS.workers)} - {worker_id}
        held = {rid.decode() for rid in r.hkeys(KEYS.assigned(worker_id))}
        wait_for(lambda: all(r.llen(KEYS.progress(rid)) >= 3 for rid in held), 60, "a few tokens of each stream")
        process = next(p for _, p in chaos.stack.processes if p.pid == pid_of(worker_id))
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        print(f"SIGTERM with 8 streams: the worker exited {time.monotonic() - sent:.2f} s later")
        results = [s.result()[0] for s in streams]
    for got in results:
        assert got.indexes == list(range(count)) and got.text == expected and got.final["completion_tokens"] == count
    handed = [got for got in results if got.request_id in held]
    assert len(handed) == len(held) > 0
    for got in results:
        moved = got.request_id in held
        assert dispatched_to(chaos.url, got.request_id) == ([worker_id, other] if moved else [other])
        assert workers_of(chaos.url, got.request_id, "finished") == [other]
    restore_workers(chaos)


def test_the_scheduler_restarts_under_load_and_nothing_is_lost(chaos: PrivateStack) -> None:
    expected = reference(chaos)
    scheduler = next(p for name, p in chaos.stack.processes if name == "scheduler" and p.poll() is None)

    def kill_scheduler(_request_id: str) -> None:
        scheduler.kill()

    with ThreadPoolExecutor(4) as pool:
        # A stream runs on a worker while the scheduler dies; four more requests arrive meanwhile.
        running = pool.submit(stream_with_fault, chaos, 2, kill_scheduler)
        wait_for(lambda: scheduler.poll() is not None, 30, "the scheduler to die")
        later = [pool.submit(lambda: httpx.post(f"{chaos.url}/generate", json=LONG, timeout=120)) for _ in range(3)]
        r = client_of(chaos)
        wait_for(lambda: r.get(KEYS.queued) == b"3", 30, "the later requests to be queued with no scheduler")
        chaos.stack.spawn("scheduler")
        got, _ = running.result()
        answers = [f.result() for f in later]
    assert got.indexes == list(range(40)) and got.text == expected
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all(a.json()["text"] == expected for a in answers)
    wait_for(lambda: not any(r.hlen(KEYS.assigned(w.decode())) for w in r.smembers(KEYS.workers)), 10,
             "every assignment to be released")


def test_a_standby_scheduler_takes_over_queued_requests(chaos: PrivateStack) -> None:
    """A namespace with no worker: requests only queue. Kill the leader; the standby must
    recover its queue, which shows as each request timing out instead of hanging."""
    port = free_port()
    services = Stack({**chaos.stack.env, "NAMESPACE": "standby", "GATEWAY_PORT": str(port)})
    for name in ("scheduler", "scheduler", "gateway"):
        services.spawn(name)
    url = f"http://127.0.0.1:{port}"
    r = client_of(chaos)
    try:
        wait_for(lambda: responds(f"{url}/health") and r.get(Keys("standby").lease), 30,
                 "the gateway and a leader")
        leader_pid = pid_of(r.get(Keys("standby").lease).decode())
        leader = next(process for _, process in services.processes if process.pid == leader_pid)
        body = {"prompt": "Hi", "max_tokens": 2, "timeout": 6}
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(httpx.post, f"{url}/generate", json=body, timeout=60) for _ in range(3)]
            wait_for(lambda: r.get(Keys("standby").queued) == b"3", 10, "three queued requests")
            leader.kill()
            statuses = [a.result().status_code for a in answers]
        assert statuses == [503, 503, 503]
        assert all(a.result().json()["error"]["code"] == "queue_timeout" for a in answers)
        assert r.get(Keys("standby").queued) == b"0"
    finally:
        services.stop()


def test_redis_restart_fails_in_flight_requests_clearly_and_service_resumes(chaos: PrivateStack) -> None:
    alive = [process for _, process in chaos.stack.processes if process.poll() is None]
    got, _ = stream_with_fault(chaos, 3, lambda _rid: chaos.stop_redis(), LONGER)
    assert got.ended == "error" and got.final["error"]["code"] == "redis_unavailable", got.final
    assert got.indexes == list(range(len(got.indexes))) and got.indexes[-1] >= 3
    health = httpx.get(f"{chaos.url}/health")
    assert health.status_code == 503 and health.json()["redis"] is False
    refused = httpx.post(f"{chaos.url}/generate", json=LONG, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "redis_unavailable"
    chaos.start_redis()
    started = time.monotonic()

    def serves() -> bool:
        try:
            return httpx.post(f"{chaos.url}/generate", json={**LONG, "max_tokens": 4}, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(serves, 30, "the stack to serve again", interval=0.5)
    print(f"redis restart: serving again {time.monotonic() - started:.1f} s after Redis came back")
    assert all(process.poll() is None for process in alive)  # no service had to restart


def test_requests_wait_for_a_worker_and_run_when_one_comes(chaos: PrivateStack) -> None:
    """A namespace whose only worker starts after the request arrived."""
    port = free_port()
    services = Stack({**chaos.stack.env, "NAMESPACE": "late", "GATEWAY_PORT": str(port)})
    for name in ("scheduler", "gateway"):
        services.spawn(name)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: responds(f"{url}/health"), 30, "the gateway")
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{url}/generate", json={"prompt": "Hi", "max_tokens": 3}, timeout=180)
            r = client_of(chaos)
            wait_for(lambda: r.get(Keys("late").queued) == b"1", 30, "the request to be queued")
            assert not answer.done()
            services.spawn("worker")
            assert answer.result().status_code == 200
    finally:
        services.stop()


def test_past_the_migration_limit_the_client_gets_a_clear_error(chaos: PrivateStack) -> None:
    scheduler = Scheduler(Settings(redis_url=chaos.redis_url, namespace="limit", migration_limit=2))
    listener = client_of(chaos).pubsub()
    listener.subscribe(Keys("limit").results("r1"))
    wait_for(lambda: listener.get_message(timeout=1), 5, "the subscription")
    pipe = scheduler.redis.pipeline()
    scheduler.roster.migrate(pipe, Submit("r1", SamplingParams(), prompt="x", migrations=2), [5, 6])
    pipe.execute()
    message = wait_for(lambda: listener.get_message(timeout=1), 5, "the error")
    error = decode(message["data"], Result, 1 << 20)
    assert isinstance(error, Error) and error.code == "migration_limit"
    assert client_of(chaos).xlen(Keys("limit").requests) == 0  # not re-queued
