"""A request's owner fences its results (Keys.owner, common/resultlog.py): on a real redis-server with the script
every service publishes with, a worker's results are taken while the request is its own or nobody's known, and
refused once the scheduler moved it (owner '') or gave it to another worker, or after it ended; a refused write
adds nothing to the progress list the next worker resumes from, publishes nothing and recreates no key. Then a
whole stack whose worker sits behind a proxy: cut off past WORKER_TTL mid-stream, healed after its streams moved,
its held-back writes land and are refused, and every stream ends whole with the fault-free text."""

from __future__ import annotations

import os
import signal

import httpx
import redis

from common.clients import sync_client
from common.keys import Keys
from common.protocol import Done, Token, encode
from common.resultlog import publish_results, refused
from common.settings import Settings
from harness.proxy import SentinelProxy
from tests.conftest import pid_of, redis_server, sim_stack, wait_for, workers_of
from tests.sse import read_in_background

LIMIT = 1 << 20
TOKENS = 600


def publish(client: redis.Redis, keys: Keys, rid: str, index: int, writer: str, ending: bool = False) -> set[str]:
    """One result of `rid` as `writer` writes it; the request ids refused."""
    settings = Settings(resume_ttl=60.0)
    pipe = client.pipeline(transaction=False)
    result = encode(Done("length", 1, index) if ending else Token(index, "w"), LIMIT)
    calls = publish_results(pipe, keys, settings, [(rid, result, "" if ending else index)], writer=writer,
                            ending=ending)
    return refused(calls, pipe.execute())


def test_a_worker_writes_only_what_it_owns() -> None:
    with redis_server() as url:
        client, keys = redis.Redis.from_url(url), Keys("fence")
        assert publish(client, keys, "r", 0, "A") == set()  # no owner known: taken (a scheduler of before)
        client.set(keys.owner("r"), "A")
        assert publish(client, keys, "r", 1, "A") == set()
        client.set(keys.owner("r"), "")  # the scheduler moves it
        assert publish(client, keys, "r", 2, "A") == {"r"}
        client.set(keys.owner("r"), "B")  # and gives it to B
        assert publish(client, keys, "r", 2, "A") == {"r"}
        assert publish(client, keys, "r", 2, "B") == set()
        assert client.lrange(keys.progress("r"), 0, -1) == [b"0", b"1", b"2"]  # A's late token 2 is not in it
        assert publish(client, keys, "r", 3, "B", ending=True) == set()
        assert not client.exists(keys.progress("r"))  # the ending deletes it
        assert client.get(keys.owner("r")) == b"" and 0 < client.ttl(keys.owner("r")) <= 60
        assert publish(client, keys, "r", 3, "A") == {"r"}  # a late write after the end recreates nothing
        assert not client.exists(keys.progress("r"))
        # A service (no writer) is never fenced.
        assert publish(client, keys, "r", 4, "") == set()


def test_a_partitioned_workers_late_writes_are_refused_and_every_stream_is_whole() -> None:
    """Two workers, the second behind a proxy. Cut off past WORKER_TTL, its streams move to the first; healed,
    the token writes it sent before the cut reach Redis after the move, which without the fence would add to
    the progress lists the first worker resumed from. Then kill -9 of the first worker: the streams move back
    to the second, resuming from those lists, and must still end whole with the fault-free text."""
    with sim_stack(1, redis="sentinel", NAMESPACE="fence", SIM_STEP_MS="20", SIM_STEP_PER_SEQ_MS="0",
                   WORKER_TTL="2", HEARTBEAT_INTERVAL="0.3", LOG_LEVEL="WARNING") as running:
        group, keys = running.topology, Keys("fence")
        r = sync_client(running.redis_url)
        [direct] = [member.decode() for member in r.smembers(keys.workers)]
        proxy = SentinelProxy([group.sentinel_port], group.service)
        proxy.start()
        try:
            running.stack.spawn("worker", REDIS_URL=proxy.url)
            wait_for(lambda: r.scard(keys.workers) == 2, 60, "the proxied worker")
            bodies = [{"prompt": "through a partition", "max_tokens": TOKENS, "ignore_eos": True}] * 8
            expected = httpx.post(f"{running.url}/generate", json=bodies[0], timeout=60).json()["text"]
            reading = read_in_background(running.url, bodies)
            wait_for(lambda: all(len(s.events) > 20 for s in reading.streams), 60, "every stream under way")
            cut_off = [s for s in reading.streams if workers_of(running.url, s.request_id) != [direct]]
            assert cut_off, "no stream ran on the proxied worker"
            proxy.cut()
            wait_for(lambda: all(len(workers_of(running.url, s.request_id)) == 2 for s in cut_off), 30,
                     "the cut-off streams moved to the other worker")
            healed = proxy.heal()
            # What the cut held back, the worker's late token writes among it, is written on to Redis before the
            # kill: Redis applies it ahead of anything later on that connection, and the streams move back (and
            # their progress lists are read) only once the killed worker's WORKER_TTL has passed.
            wait_for(lambda: proxy.undelivered(arrived_before=healed) == 0, 30, "the held-back writes handed on")
            wait_for(lambda: r.scard(keys.workers) == 2, 30, "the proxied worker back")
            os.kill(pid_of(direct), signal.SIGKILL)
            reading.join(120)
        finally:
            proxy.stop()
        for stream in reading.streams:
            assert stream.ended == "done" and stream.indexes == list(range(TOKENS)), stream.indexes[-3:]
            assert stream.text == expected
        assert not list(r.scan_iter(keys.progress("*")))  # every list gone with its request, none recreated
