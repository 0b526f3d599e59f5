"""A worker's own keys in Redis (its inbox, its assignments, its heartbeat, its place in the set of workers) go
with it: 50 ENGINE=sim workers started and stopped under streams, by SIGTERM and by kill -9, one round of them
while no scheduler runs, leave no key without a TTL behind, and every stream they held ends whole elsewhere
(real redis-server, gateway, scheduler, each its own process)."""

from __future__ import annotations

import contextlib

import redis

from common.clients import sync_client
from common.keys import Keys
from harness.stacks import lasting, live_workers
from tests.conftest import pid_of, sim_stack, wait_for
from tests.sse import Reading, read_in_background

NS = "keys"
KEYS = Keys(NS)
ROUNDS, PER_ROUND = 5, 10
# Long enough to be running when its worker stops, short enough that the SIGTERM'd (which finish what they
# run: the others have no room to take it) are gone within seconds.
TOKENS = 150


def beating(r: redis.Redis, pids: set[int]) -> set[str] | None:
    """The ids of the workers of these processes, once every one of them beats."""
    ids = {i for i in live_workers(r, KEYS) if pid_of(i) in pids}
    return ids if len(ids) == len(pids) else None


def owned_by(r: redis.Redis, worker_ids: set[str]) -> list[str]:
    """The keys of these workers' own, and their heartbeats."""
    own = [key.decode() for key in r.scan_iter(match=KEYS.worker_keys(), count=1000)
           if KEYS.worker_of(key.decode()) in worker_ids]
    return own + [KEYS.heartbeat(i) for i in worker_ids if r.exists(KEYS.heartbeat(i))]


def test_fifty_workers_started_and_stopped_leave_no_key_without_a_ttl() -> None:
    # A stream may move several times a round (a SIGTERM'd worker hands off to one about to stop): no limit here.
    with sim_stack(0, NAMESPACE=NS, WORKER_SLOTS="2", MIGRATION_LIMIT="1000") as running:
        r = sync_client(running.redis_url)
        before = lasting(r)
        stopped: set[str] = set()
        readings: list[Reading] = []
        for round_ in range(ROUNDS):
            processes = [running.stack.spawn("worker") for _ in range(PER_ROUND)]
            pids = {p.pid for p in processes}
            ids = wait_for(lambda pids=pids: beating(r, pids), 120, f"round {round_}'s workers to beat", 0.3)
            readings.append(read_in_background(running.url, [
                {"prompt": f"round {round_} stream {i}", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
                for i in range(2 * PER_ROUND)], timeout=300))
            # Each holds work (an inbox and assignments) when it stops.
            wait_for(lambda ids=ids: all(r.hlen(KEYS.assigned(i)) for i in ids), 60,
                     f"round {round_}'s workers to be given streams")
            scheduler = None
            if round_ == 2:  # these leave while no scheduler leads: the next one finds them by their keys alone
                scheduler = next(p for name, p in running.stack.processes if name == "scheduler" and p.poll() is None)
                scheduler.kill()
                scheduler.wait()
            for n, process in enumerate(processes):
                if n % 2:
                    process.kill()
                else:
                    process.terminate()
            for process in processes:
                process.wait(60)
            if scheduler is not None:
                running.stack.spawn("scheduler")
            stopped |= ids
        running.stack.spawn("worker", WORKER_SLOTS="64")  # takes what the last round's killed workers held
        for reading in readings:
            reading.join(300)
        streams = [s for reading in readings for s in reading.streams]
        assert all(s.ended == "done" and s.indexes == list(range(TOKENS)) for s in streams), \
            [(s.request_id, s.ended, s.final) for s in streams if s.ended != "done" or len(s.indexes) != TOKENS]
        assert len(stopped) == ROUNDS * PER_ROUND
        # The scheduler lost each of them (their work moved), and removed what was theirs.
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not owned_by(r, stopped), 30, "the stopped workers' keys to go")
        assert not owned_by(r, stopped), owned_by(r, stopped)
        assert not stopped & {member.decode() for member in r.smembers(KEYS.workers)}
        left = {key for key in lasting(r) - before
                if any(worker_id in key for worker_id in stopped) or not key.startswith(f"{{{NS}}}:")}
        assert not left, sorted(left)


def test_keys_of_a_stopped_worker_nobody_saw_leave_lapse() -> None:
    """Without any scheduler, a cleanly stopped worker's keys still expire: nothing a scheduler wrote lasts."""
    with sim_stack(1, NAMESPACE=NS) as running:
        r = sync_client(running.redis_url)
        [worker_id] = live_workers(r, KEYS)
        reading = read_in_background(running.url, [{"prompt": "one", "max_tokens": 5}])
        reading.join(60)
        assert r.exists(KEYS.inbox(worker_id))
        for name in ("scheduler", "worker"):
            process = next(p for n, p in running.stack.processes if n == name)
            process.terminate()
            process.wait(60)
        assert all(r.ttl(key) > 0 for key in owned_by(r, {worker_id})), \
            {key: r.ttl(key) for key in owned_by(r, {worker_id})}
