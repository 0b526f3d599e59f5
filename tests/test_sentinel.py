"""Redis under Sentinel (REDIS_URL=redis+sentinel://...): a primary, a replica and one Sentinel started on
free ports, a sim stack on them, and the primary failing over in the middle of streams, by `SENTINEL
FAILOVER` and by kill -9 of the primary. Each stream ends whole or with a clear `redis_unavailable` error,
none hangs, and the stack serves again on the new primary without any service restarting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserve.launcher import PrivateStack, private_stack, wait_until
from tests.sse import events

TOKENS = 600  # 12 s at 20 ms a step: longer than Sentinel takes to demote the old primary
SIM = {"ENGINE": "sim", "SIM_STEP_MS": "20", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2", "LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def sentinel_stack() -> Iterator[PrivateStack]:
    with private_stack(2, redis="sentinel", **SIM) as running:
        yield running


def stream(url: str) -> tuple[str, list[int], dict]:
    body = {"prompt": "through a failover", "max_tokens": TOKENS, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/generate_stream", json=body) as response:
        if response.status_code != 200:
            return f"status {response.status_code}", [], {}
        got = list(events(response))
    return ("error" if got[-1].event == "error" else "done"), [e.data["index"] for e in got if "index" in e.data], \
        got[-1].data


def streams_through(running: PrivateStack, fault: Callable[[], object]) -> list[tuple[str, list[int], dict]]:
    with ThreadPoolExecutor(6) as pool:
        started = [pool.submit(stream, running.url) for _ in range(6)]
        time.sleep(1.5)
        fault()
        return [s.result() for s in started]


def check_each_ended_whole_or_clearly(ended: list[tuple[str, list[int], dict]]) -> None:
    for how, indexes, last in ended:
        assert indexes == list(range(len(indexes))), "a gap or a repeat"
        if how == "done":
            assert len(indexes) == TOKENS and last["finish_reason"] == "length"
        else:
            assert how == "error" and last["error"]["code"] == "redis_unavailable", (how, last)
    print("outcomes:", sorted(how for how, _, _ in ended))


def serves(url: str) -> bool:
    try:
        return httpx.post(f"{url}/generate", json={"prompt": "x", "max_tokens": 3}, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_sentinel_failover_mid_stream(sentinel_stack: PrivateStack) -> None:
    group = sentinel_stack.topology
    before = group.primary_port()
    started = time.monotonic()
    ended = streams_through(sentinel_stack, group.failover)
    print(f"SENTINEL FAILOVER: streams ended within {time.monotonic() - started:.1f} s")
    assert group.primary_port() != before
    check_each_ended_whole_or_clearly(ended)
    wait_until(lambda: serves(sentinel_stack.url), 30, "the stack to serve on the new primary", 0.2)
    assert not sentinel_stack.stack.exited()


def test_the_primary_killed_mid_stream(sentinel_stack: PrivateStack) -> None:
    group = sentinel_stack.topology
    group.settle()  # the old primary follows the new one: there is a replica to promote
    primary = group.primary_port()
    process = next(p for p, port in zip(group.processes, group.ports, strict=False) if port == primary)

    def kill() -> None:
        process.kill()

    started = time.monotonic()
    ended = streams_through(sentinel_stack, kill)
    print(f"primary kill -9: streams ended within {time.monotonic() - started:.1f} s")
    assert [how for how, _, _ in ended] == ["error"] * 6  # its data is gone with it
    check_each_ended_whole_or_clearly(ended)
    wait_until(lambda: group.primary_port() != primary, 30, "Sentinel to promote the replica")
    wait_until(lambda: serves(sentinel_stack.url), 30, "the stack to serve on the new primary", 0.2)
    assert not sentinel_stack.stack.exited()
