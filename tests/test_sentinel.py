"""Redis under Sentinel (REDIS_URL=redis+sentinel://...): a primary, a replica and one Sentinel started on
free ports, a sim stack on them, and the primary failing over in the middle of streams, by `SENTINEL
FAILOVER` and by kill -9 of the primary. Each stream ends whole or with a clear `redis_unavailable` error,
none hangs, and the stack serves again on the new primary without any service restarting. Then groups run
with `min-replicas-to-write 1` (bench/sentinel_writes.py): no acknowledged write lost with one replica, and the
client off the old primary at its first refusal with two."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.sentinel_writes import through_failover
from harness.stacks import PrivateStack
from llmserve.processes import wait_until
from tests.conftest import sim_stack
from tests.sse import Streamed, read

TOKENS = 600  # 12 s at 20 ms a step: longer than Sentinel takes to demote the old primary


@pytest.fixture(scope="module")
def sentinel_stack() -> Iterator[PrivateStack]:
    with sim_stack(2, redis="sentinel", LOG_LEVEL="ERROR") as running:
        yield running


def streams_through(running: PrivateStack, fault: Callable[[], object]) -> list[Streamed]:
    """Six streams, `fault()` once each has its first tokens."""
    streams = [Streamed() for _ in range(6)]
    body = {"prompt": "through a failover", "max_tokens": TOKENS, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        started = [pool.submit(read, running.url, "/generate_stream", body=body, timeout=60, into=s) for s in streams]
        wait_until(lambda: all(len(s.events) >= 5 for s in streams), 30, "every stream under way", 0.05)
        fault()
        return [s.result() for s in started]


def check_each_ended_whole_or_clearly(ended: list[Streamed]) -> None:
    for got in ended:
        assert got.indexes == list(range(len(got.indexes))), "a gap or a repeat"
        if got.ended == "done":
            assert len(got.indexes) == TOKENS and got.final["finish_reason"] == "length"
        else:
            assert got.ended == "error" and got.final["error"]["code"] == "redis_unavailable", (got.ended, got.final)
    print("outcomes:", sorted(got.ended for got in ended))


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
    took = time.monotonic() - started
    print(f"SENTINEL FAILOVER: streams ended within {took:.1f} s")
    # The gateway left the old primary's pub/sub once Sentinel named the new one, not at its demotion (~10 s on).
    assert took < 6.0
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
    assert [got.ended for got in ended] == ["error"] * 6  # its data is gone with it
    check_each_ended_whole_or_clearly(ended)
    wait_until(lambda: group.primary_port() != primary, 30, "Sentinel to promote the replica")
    wait_until(lambda: serves(sentinel_stack.url), 30, "the stack to serve on the new primary", 0.2)
    assert not sentinel_stack.stack.exited()



def test_no_acknowledged_write_is_lost_to_a_failover_with_min_replicas_to_write() -> None:
    """One replica and min-replicas-to-write 1: the old primary refuses writes from the moment its replica is
    promoted, so none it acknowledged is dropped at its demotion (without the setting, every write of the
    ten seconds before the demotion is). The refusals are Redis trouble the services wait out."""
    row = through_failover(replicas=1, write_replicas=1)
    print(row)
    assert not row["unexpected"], row
    assert row["acknowledged"] > 50 and row["refused_writes"] > 0, row
    assert row["lost"] == 0, row


def test_the_client_leaves_an_old_primary_at_its_first_refusal() -> None:
    """Two replicas and min-replicas-to-write 1: once Sentinel has moved the other replica to the new primary,
    the old one refuses writes (NOREPLICAS) and the client asks Sentinel again at once; writes go on there
    within seconds, long before the old primary's demotion would have closed its connection."""
    row = through_failover(replicas=2, write_replicas=1)
    print(row)
    assert not row["unexpected"], row
    assert row["refusal"].startswith("the primary refused a write for want of replicas"), row
    assert row["longest_pause_s"] < 5.0, row
