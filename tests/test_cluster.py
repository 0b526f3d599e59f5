"""Redis Cluster: REDIS_URL's schemes, key names grouped by hash slot, the gateway's sharded pub/sub on a
real cluster of three masters (routing across nodes, a stale slot map, a slot that moves, a node that
dies), a master killed under a sim stack mid-stream (with and without replicas), and the end-to-end tests
of streaming, the OpenAI API, resuming, worker migration and scheduler restarts run unchanged against a
cluster (their bodies are imported from their modules; the fixtures they take are this module's, on a
cluster)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from common.clients import async_client, parse_redis_url, sync_client
from common.errors import ErrorCode
from common.keys import Keys
from common.protocol import Done, Error, Token, encode
from common.resultlog import publish_results
from common.scripts import PUBLISH_RESULTS
from common.settings import Settings, SettingsError
from gateway.shards import ShardedRouter
from harness.stacks import PrivateStack, private_stack
from harness.topology import Cluster, start_cluster
from llmserve.processes import free_port, wait_until
from tests import test_faults, test_openai, test_resume, test_stack, test_structured, test_tokenize
from tests.conftest import RunningStack, sim_stack
from tests.sse import Streamed, read

LIMIT = 1 << 20


# REDIS_URL and key names.

def test_each_scheme_selects_its_kind_of_redis() -> None:
    assert parse_redis_url("redis://127.0.0.1:6379/0").mode == "single"
    assert parse_redis_url("unix:///run/redis.sock").mode == "single"
    cluster = parse_redis_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2")
    assert (cluster.mode, cluster.nodes, cluster.password) == ("cluster", (("10.0.0.1", 7000), ("10.0.0.2", 6379)),
                                                              "pw")
    sentinel = parse_redis_url("redis+sentinel://s1:26380,[::1]/primary/2")
    assert (sentinel.mode, sentinel.nodes, sentinel.service, sentinel.db) == (
        "sentinel", (("s1", 26380), ("::1", 26379)), "primary", 2)


@pytest.mark.parametrize("url", ["http://x:1", "redis+cluster://h:port", "redis+cluster://h:1/3",
                                 "redis+sentinel://h:26379", "redis+sentinel://h/name/db", "redis+cluster://"])
def test_a_bad_redis_url_fails_at_start_naming_the_variable(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", url)
    with pytest.raises(SettingsError, match=r"^REDIS_URL="):
        Settings.from_env()


def test_the_keys_each_script_touches_share_one_slot() -> None:
    keys = Keys("ns")
    shared = [keys.requests, keys.events, keys.queued, keys.queued_bytes, keys.in_flight("t"), keys.leases,
              keys.workers, keys.heartbeat("w1"), keys.heartbeat("w2"), keys.lease, keys.clean_exit]
    request = [keys.results("r1"), keys.progress("r1"), keys.log("r1"), keys.trace("r1")]
    worker = [keys.inbox("w1"), keys.assigned("w1")]
    for group in (shared, request, worker):
        assert len({key_slot(k.encode()) for k in group}) == 1, group
    assert len({key_slot(keys.results(f"r{i}").encode()) for i in range(100)}) > 90  # requests spread


class Recorder:
    """A pipeline that records the commands queued on it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def execute_command(self, *args: object) -> None:
        self.calls.append(args)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1"])
def test_a_steps_results_take_one_script_call_per_slot(url: str) -> None:
    keys, rids = Keys("ns"), [f"r{i}" for i in range(20)]
    pipe = Recorder()
    publish_results(pipe, keys, Settings(redis_url=url), [(rid, b"x", i) for i, rid in enumerate(rids)])
    cluster = "cluster" in url
    assert len(pipe.calls) == (20 if cluster else 1)
    for call in pipe.calls:
        assert call[:2] == ("EVAL", PUBLISH_RESULTS)
        names = call[3:3 + call[2]]
        assert len({key_slot(name.encode()) for name in names}) == 1 or not cluster
        assert call[3 + call[2]] == ("SPUBLISH" if cluster else "PUBLISH")


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://127.0.0.1:{port}", "an embedded Redis is started only for redis:// URLs"),
    ("redis+cluster://127.0.0.1:{port}/9", "REDIS_URL='redis+cluster://"),
])
def test_llmserve_up_refuses_a_cluster_it_cannot_reach_or_a_bad_url(url: str, says: str) -> None:
    """Nothing is started: a cluster (or Sentinel) is not something the launcher can start in its place."""
    env = {**os.environ, "REDIS_URL": url.format(port=free_port()), "LAUNCHER_METRICS_PORT": str(free_port())}
    done = subprocess.run([str(Path(sys.executable).with_name("llmserve")), "up"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and says in done.stderr, done.stderr


# The gateway's sharded pub/sub against a real cluster.

@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    running = start_cluster()
    yield running
    running.stop()


def node_id(port: int) -> str:
    return redis.Redis(port=port).execute_command("CLUSTER", "MYID").decode()


def move_slot(cluster: Cluster, slot: int, source: int, target: int) -> None:
    """Reassign an empty slot to another master, as resharding does."""
    redis.Redis(port=target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(source))
    redis.Redis(port=source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(target))
    for port in cluster.ports:
        redis.Redis(port=port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id(target))


def spublish(cluster: Cluster, channel: str, result: Token | Done | Error) -> None:
    """Published as a worker does, through a cluster client of its own (its slot map is fresh)."""
    sync_client(cluster.url).spublish(channel, encode(result, LIMIT))


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_sharded_results_reach_each_request_and_choice_on_every_node(cluster: Cluster) -> None:
    keys = Keys("route")
    rids = [f"r{i}" for i in range(12)]
    publisher = sync_client(cluster.url)
    assert len({publisher.get_node_from_key(keys.results(rid)).port for rid in rids}) == 3

    async def scenario() -> None:
        router = ShardedRouter(async_client(cluster.url, 8, 5), parse_redis_url(cluster.url), keys, LIMIT)
        await router.start()
        try:
            async with router.open(rids[:6]) as six, router.open(rids[6:]) as others:
                for i, rid in enumerate(rids):
                    spublish(cluster, keys.results(rid), Token(0, rid))
                    spublish(cluster, keys.results(rid), Done("length", 1, i))
                got = [await asyncio.wait_for(six.get(), 5) for _ in range(12)]
                assert sorted((c, type(r).__name__) for c, r in got) == sorted(
                    (c, kind) for c in range(6) for kind in ("Token", "Done"))
                assert all(r.text == rids[c] for c, r in got if isinstance(r, Token))
                assert len([await asyncio.wait_for(others.get(), 5) for _ in range(12)]) == 12
            assert not any(link.readers for link in router.links.values())  # unsubscribed on leaving
        finally:
            await router.stop()

    run(scenario)


def test_two_readers_of_one_stream_each_get_every_result_and_the_last_to_leave_unsubscribes(
        cluster: Cluster) -> None:
    keys = Keys("twice")
    rids = [f"t{i}" for i in range(6)]

    async def scenario() -> None:
        router = ShardedRouter(async_client(cluster.url, 8, 5), parse_redis_url(cluster.url), keys, LIMIT)
        await router.start()
        try:
            async with router.open(rids) as first:
                async with router.open(rids) as second:
                    for i, rid in enumerate(rids):
                        spublish(cluster, keys.results(rid), Token(0, rid))
                        spublish(cluster, keys.results(rid), Done("length", 1, i))
                    for mailbox in (first, second):
                        got = [await asyncio.wait_for(mailbox.get(), 5) for _ in range(12)]
                        assert sorted((c, type(r).__name__) for c, r in got) == sorted(
                            (c, kind) for c in range(6) for kind in ("Token", "Done"))
                # The second reader left; the first still reads.
                spublish(cluster, keys.results(rids[0]), Token(1, "still"))
                assert (await asyncio.wait_for(first.get(), 5)) == (0, Token(1, "still"))
            assert not any(link.readers for link in router.links.values())
        finally:
            await router.stop()

    run(scenario)


def test_a_stale_slot_map_is_followed_and_a_slot_that_moves_fails_its_request(cluster: Cluster) -> None:
    keys = Keys("moves")
    channel = keys.results("mover")
    slot = key_slot(channel.encode())
    source = sync_client(cluster.url).get_node_from_key(channel).port
    target = next(port for port in cluster.ports if port != source)

    async def scenario() -> None:
        router = ShardedRouter(async_client(cluster.url, 8, 5), parse_redis_url(cluster.url), keys, LIMIT)
        await router.start()
        try:
            async with router.open(["mover"]) as mailbox:
                spublish(cluster, channel, Token(0, "before"))
                assert (await asyncio.wait_for(mailbox.get(), 5))[1] == Token(0, "before")
                move_slot(cluster, slot, source, target)
                _, moved = await asyncio.wait_for(mailbox.get(), 5)
                assert isinstance(moved, Error) and moved.code == ErrorCode.REDIS_UNAVAILABLE
            # The router's map still names the old node, which answers MOVED: followed to the new one.
            async with router.open(["mover"]) as mailbox:
                spublish(cluster, channel, Token(1, "after"))
                assert (await asyncio.wait_for(mailbox.get(), 5))[1] == Token(1, "after")
        finally:
            await router.stop()
            move_slot(cluster, slot, target, source)

    run(scenario)


def test_a_lost_node_fails_every_request_in_flight_and_new_ones_until_it_returns(cluster: Cluster) -> None:
    """The requests' channels are all on the other nodes: the gateway sees the loss by its own link to every
    primary (a worker that cannot reach the lost node may have no way left to tell them)."""
    keys = Keys("lost")
    client = sync_client(cluster.url)
    victim = cluster.ports[0]
    rids = [rid for rid in (f"q{i}" for i in range(40)) if client.get_node_from_key(keys.results(rid)).port != victim]

    async def scenario() -> None:
        router = ShardedRouter(async_client(cluster.url, 8, 5), parse_redis_url(cluster.url), keys, LIMIT)
        await router.start()
        try:
            async with router.open(rids) as mailbox:
                cluster.kill(cluster.ports.index(victim))
                got = [await asyncio.wait_for(mailbox.get(), 5) for _ in rids]
                assert sorted(choice for choice, _ in got) == list(range(len(rids)))
                assert all(isinstance(r, Error) and r.code == ErrorCode.REDIS_UNAVAILABLE for _, r in got)
            with pytest.raises(RedisConnectionError):
                async with router.open(["after"]):
                    pass
            await asyncio.to_thread(cluster.restart, cluster.ports.index(victim))
            deadline = time.monotonic() + 15
            while router.down and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            async with router.open(rids[:1]) as mailbox:
                spublish(cluster, keys.results(rids[0]), Token(0, "back"))
                assert (await asyncio.wait_for(mailbox.get(), 5))[1] == Token(0, "back")
        finally:
            await router.stop()

    run(scenario)


# A sim stack on a cluster whose node dies mid-stream.

def long_stream(url: str, tokens: int = 400, into: Streamed | None = None) -> Streamed:
    """A stream (400 tokens: 8 s at the sim's 20 ms steps)."""
    body = {"prompt": "a long one", "max_tokens": tokens, "ignore_eos": True}
    return read(url, "/generate_stream", body=body, timeout=60, into=into)


@pytest.mark.parametrize("redis_kind", ["cluster", "cluster-with-replicas"])
def test_a_cluster_master_killed_mid_stream_ends_every_stream_clearly_and_the_stack_recovers(redis_kind: str) -> None:
    """Without replicas the stack serves again once the node is back; with them, once a replica has taken
    the lost master's slots over (the node stays dead)."""
    with sim_stack(2, redis=redis_kind, LOG_LEVEL="ERROR") as sim:
        nodes = sim.topology
        victim = nodes.ports.index(sync_client(nodes.url).get_primaries()[0].port)
        ended = [Streamed() for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(long_stream, sim.url, into=got) for got in ended]
            wait_until(lambda: all(len(got.indexes) >= 5 for got in ended), 30, "every stream under way", 0.05)
            killed_at = time.monotonic()
            nodes.kill(victim)
            ended = [stream.result() for stream in streams]
        ended_s = time.monotonic() - killed_at
        print(f"{redis_kind}, master kill -9: 8 streams ended {ended_s:.2f} s later")
        assert [got.ended for got in ended] == ["error"] * 8
        assert all(got.final["error"]["code"] == "redis_unavailable" for got in ended)
        assert all(got.indexes == list(range(len(got.indexes))) and got.indexes for got in ended)
        assert ended_s < 10
        # With replicas, one may have taken the slots over already: then the stack serves at once.
        if not nodes.replicas:
            assert httpx.get(f"{sim.url}/health").status_code == 503
            refused = httpx.post(f"{sim.url}/generate", json={"prompt": "x", "max_tokens": 2}, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "redis_unavailable"
        if not nodes.replicas:
            nodes.restart(victim)
        back = time.monotonic()

        def serves() -> bool:
            return httpx.post(f"{sim.url}/generate", json={"prompt": "x", "max_tokens": 2}, timeout=30
                              ).status_code == 200

        wait_until(serves, 30, "the stack to serve again", 0.2)
        print(f"{redis_kind}: serving again {time.monotonic() - back:.2f} s later")
        assert not sim.stack.exited()  # every service survived and reconnected
        # Resuming a stream that failed (as an EventSource does after the error) ends: its log, where it
        # survived, records the error (or, where the stack could not yet write it, the cancel that followed when
        # its lease lapsed); or the request outlived the failover on its worker and the resume gets the rest of
        # it, to its end; or it is gone with its node.
        for got in ended:
            resumed = httpx.get(f"{sim.url}/v1/requests/{got.final['sequence_id']}/stream",
                                headers={"Last-Event-ID": str(got.indexes[-1])}, timeout=15)
            assert resumed.status_code in (200, 404), resumed.text
            if resumed.status_code == 200:
                whole = '"completion_tokens":400}' in resumed.text
                assert "event: error" in resumed.text or whole, resumed.text[-600:]
        with ThreadPoolExecutor(4) as pool:
            assert [got.ended for got in pool.map(lambda _: long_stream(sim.url, 20), range(4))] == ["done"] * 4


# The existing end-to-end tests, unchanged, on a cluster: a real-model stack (streaming, OpenAI, migration,
# scheduler restarts; namespace "chaos", which test_faults' bodies use) and a sim stack with two gateways
# (resuming; test_resume's settings).

@pytest.fixture(scope="module")
def chaos() -> Iterator[PrivateStack]:
    settings = {**test_faults.SETTINGS, "SCHEDULER_METRICS_PORT": str(free_port()),
                "WORKER_METRICS_PORT": str(free_port())}
    with private_stack(2, redis="cluster", **settings) as running:
        yield running


@pytest.fixture(scope="module")
def stack(chaos: PrivateStack) -> RunningStack:
    return RunningStack(chaos.url, sync_client(chaos.redis_url), Keys(test_faults.NS), chaos.stack)


@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    with sim_stack(1, gateways=2, redis="cluster", **test_resume.SETTINGS) as running:
        yield running



# Collected here in this order: the stack's own tests first, the faults (which kill workers) last.
test_stream_sends_one_event_per_token_then_a_final_event = (
    test_stack.test_stream_sends_one_event_per_token_then_a_final_event)
test_stream_text_equals_the_whole_completion = test_stack.test_stream_text_equals_the_whole_completion
test_generate_list_returns_one_completion_per_prompt_in_order = (
    test_stack.test_generate_list_returns_one_completion_per_prompt_in_order)
test_concurrent_streams_each_get_only_their_own_tokens = (
    test_stack.test_concurrent_streams_each_get_only_their_own_tokens)
test_a_client_that_disconnects_frees_its_slot = test_stack.test_a_client_that_disconnects_frees_its_slot
test_malformed_bus_messages_are_dropped_and_consumers_keep_running = (
    test_stack.test_malformed_bus_messages_are_dropped_and_consumers_keep_running)
test_completion_whole_and_streamed_agree = test_openai.test_completion_whole_and_streamed_agree
test_chat_uses_the_template_and_streams = test_openai.test_chat_uses_the_template_and_streams
test_n_choices_and_seeds = test_openai.test_n_choices_and_seeds
test_stop_strings_end_the_text_without_returning_them = (
    test_openai.test_stop_strings_end_the_text_without_returning_them)
test_a_seed_stream_resumes_on_the_other_gateway_with_every_token_once = (
    test_resume.test_a_seed_stream_resumes_on_the_other_gateway_with_every_token_once)
test_openai_streams_resume_exactly_with_one_id_for_every_choice = (
    test_resume.test_openai_streams_resume_exactly_with_one_id_for_every_choice)
test_only_the_key_that_created_a_stream_may_resume_it = (
    test_resume.test_only_the_key_that_created_a_stream_may_resume_it)
test_a_stream_nobody_resumes_is_cancelled_after_the_grace = (
    test_resume.test_a_stream_nobody_resumes_is_cancelled_after_the_grace)
test_a_client_back_within_the_grace_keeps_its_request_and_delete_cancels_it = (
    test_resume.test_a_client_back_within_the_grace_keeps_its_request_and_delete_cancels_it)
test_a_log_trimmed_past_the_clients_position_is_a_410 = (
    test_resume.test_a_log_trimmed_past_the_clients_position_is_a_410)
test_counts_are_what_generation_bills_and_ids_round_trip = (
    test_tokenize.test_counts_are_what_generation_bills_and_ids_round_trip)
test_a_tool_call_stream_broken_mid_call_resumes_exactly = (
    test_structured.test_a_tool_call_stream_broken_mid_call_resumes_exactly)
test_a_killed_workers_stream_continues_on_another_without_loss_or_duplicate = (
    test_faults.test_a_killed_workers_stream_continues_on_another_without_loss_or_duplicate)
test_the_scheduler_restarts_under_load_and_nothing_is_lost = (
    test_faults.test_the_scheduler_restarts_under_load_and_nothing_is_lost)
test_a_standby_scheduler_takes_over_queued_requests = test_faults.test_a_standby_scheduler_takes_over_queued_requests
