"""The scheduler against a real redis-server, driven tick by tick: messages it builds always fit the bus,
one request's trouble fails that request alone, and no state in Redis can crash-loop it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from common.errors import ErrorCode
from common.keys import PAYLOAD, WORKER_KEYS_TTL_SECONDS, Keys
from common.protocol import (
    Batch,
    Cancel,
    Error,
    Finished,
    Heartbeat,
    InboxMessage,
    Result,
    SamplingParams,
    Submit,
    TraceEvent,
    Unheld,
    Yield,
    Yielded,
    decode,
    encode,
)
from common.settings import Settings
from scheduler.main import Scheduler
from scheduler.policy import BATCH_OVERHEAD, YIELD_LIMIT
from tests.conftest import redis_server

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return request.node.name[:40]


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def scheduler(redis_url: str, ns: str, **settings: object) -> Scheduler:
    return Scheduler(Settings(redis_url=redis_url, namespace=ns, max_message_bytes=LIMIT, **settings))


def submit(r: redis.Redis, keys: Keys, rid: str, prompt_bytes: int = 10, **fields: object) -> Submit:
    """Queue a request as the gateway does: the stream entry and both admission counters."""
    message = Submit(rid, SamplingParams(), prompt="x" * prompt_bytes, **fields)
    payload = encode(message, LIMIT)
    r.xadd(keys.requests, {PAYLOAD: payload})
    r.incr(keys.queued)
    r.incrby(keys.queued_bytes, len(payload))
    return message


def worker_beat(r: redis.Redis, keys: Keys, worker_id: str, slots: int = 16) -> None:
    r.set(keys.heartbeat(worker_id), encode(Heartbeat(worker_id, "m", 8192, slots, 0, 0, 0, 0.0), LIMIT), px=60_000)
    r.sadd(keys.workers, worker_id)


class Listener:
    """Results published on some requests' channels, subscribed to before anything can be published."""

    def __init__(self, r: redis.Redis, keys: Keys, *rids: str) -> None:
        self.pubsub = r.pubsub()
        self.pubsub.subscribe(*(keys.results(rid) for rid in rids))
        for _ in rids:
            self.pubsub.get_message(timeout=2)

    def results(self) -> list[Result]:
        got = []
        while message := self.pubsub.get_message(timeout=0.5):
            if message["type"] == "message":
                got.append(decode(message["data"], Result, LIMIT))
        return got


def inbox_batches(r: redis.Redis, keys: Keys, worker_id: str) -> list[tuple[int, Batch]]:
    return [(len(fields[PAYLOAD]), decode(fields[PAYLOAD], Batch, LIMIT))
            for _, fields in r.xrange(keys.inbox(worker_id))]


def test_requests_queued_with_no_worker_go_out_in_messages_that_fit(r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    s = scheduler(redis_url, ns)
    s._take_over()
    sent = [submit(r, keys, f"r{i}", prompt_bytes=95_000) for i in range(12)]
    s._tick()
    assert len(s.queue) == 12
    worker_beat(r, keys, "w1")
    s.roster.next_refresh = 0
    s._tick()
    batches = inbox_batches(r, keys, "w1")
    assert len(batches) >= 2 and all(size <= LIMIT for size, _ in batches)
    assert sorted(q.request_id for _, b in batches for q in b.sequences) == sorted(m.request_id for m in sent)
    # Consumed entries are deleted, and the admission counters are back where they started.
    assert r.xlen(keys.requests) == 0
    assert int(r.get(keys.queued)) == 0 and int(r.get(keys.queued_bytes)) == 0


def test_a_request_no_batch_can_carry_fails_alone(r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    s = scheduler(redis_url, ns)
    s._take_over()
    worker_beat(r, keys, "w1")
    listener = Listener(r, keys, "big", "small")
    fields = len(encode(Submit("big", SamplingParams(), prompt=""), LIMIT))  # a Submit's bytes but its prompt's
    submit(r, keys, "big", prompt_bytes=LIMIT - fields - BATCH_OVERHEAD // 2)  # fits the stream, not a batch
    submit(r, keys, "small")
    s._tick()
    [error] = listener.results()
    assert isinstance(error, Error) and error.code == ErrorCode.REQUEST_TOO_LARGE
    [(_, batch)] = inbox_batches(r, keys, "w1")
    assert [q.request_id for q in batch.sequences] == ["small"]
    assert int(r.get(keys.queued_bytes)) == 0


def test_a_lost_request_that_no_longer_fits_fails_and_its_worker_mates_move(r: redis.Redis, redis_url: str,
                                                                             ns: str) -> None:
    keys = Keys(ns)
    s = scheduler(redis_url, ns)
    s._take_over()
    big = Submit("big", SamplingParams(), prompt="x" * (LIMIT - BATCH_OVERHEAD - 200))
    small = Submit("small", SamplingParams(), prompt="hi")
    r.hset(keys.assigned("dead"), mapping={"big": encode(big, LIMIT), "small": encode(small, LIMIT)})
    r.rpush(keys.progress("big"), *range(40_000, 40_200))
    r.rpush(keys.progress("small"), 7, 8)
    r.sadd(keys.workers, "dead")  # listed, with no heartbeat: gone
    worker_beat(r, keys, "w2")
    listener = Listener(r, keys, "big", "small")
    s._tick()
    s._tick()  # the migrated request comes back through the stream
    [error] = listener.results()
    assert isinstance(error, Error) and error.code == ErrorCode.REQUEST_TOO_LARGE
    [(_, batch)] = inbox_batches(r, keys, "w2")
    assert [(q.request_id, q.resume, q.migrations) for q in batch.sequences] == [("small", [7, 8], 1)]
    assert not r.exists(keys.assigned("dead")) and not r.sismember(keys.workers, "dead")
    scheduler(redis_url, ns)._take_over()  # a later leader starts cleanly


def test_what_finished_just_before_its_worker_left_is_released_not_run_again(r: redis.Redis, redis_url: str,
                                                                           ns: str) -> None:
    keys = Keys(ns)
    s = scheduler(redis_url, ns)
    s._take_over()
    worker_beat(r, keys, "w1")
    worker_beat(r, keys, "w2")
    s.roster.next_refresh = 0
    s._tick()
    done, running = (Submit(rid, SamplingParams(), prompt="hi") for rid in ("done", "running"))
    r.hset(keys.assigned("w1"), mapping={"done": encode(done, LIMIT), "running": encode(running, LIMIT)})
    r.rpush(keys.progress("running"), 7)
    # w1's last step releases "done", then w1 leaves (as a drained worker does), all between two of the scheduler's
    # reads of the events: it sees w1 gone before it has read that Finished.
    r.xadd(keys.events, {PAYLOAD: encode(Finished("w1", "done"), LIMIT)})
    r.delete(keys.heartbeat("w1"))
    r.srem(keys.workers, "w1")
    s.roster.refresh()
    s._tick()
    moved = [(q.request_id, q.resume) for _, batch in inbox_batches(r, keys, "w2") for q in batch.sequences]
    assert moved == [("running", [7])]


def test_an_exception_on_one_request_fails_only_that_request(r: redis.Redis, redis_url: str, ns: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    keys = Keys(ns)
    s = scheduler(redis_url, ns)
    s._take_over()
    add = s.queue.add

    def explode_on_bad(queued: object) -> None:
        if queued.request_id == "bad":
            raise RuntimeError("boom")
        add(queued)

    monkeypatch.setattr(s.queue, "add", explode_on_bad)
    listener = Listener(r, keys, "bad", "good")
    submit(r, keys, "bad")
    submit(r, keys, "good")
    s._tick()
    [error] = listener.results()
    assert isinstance(error, Error) and error.code == ErrorCode.DEAD_LETTER
    assert [q.request_id for q in s.queue] == ["good"]
    [letter] = r.xrange(keys.dead_letters)
    assert letter[1][b"request_id"] == b"bad"


def test_a_request_pending_through_repeated_crashes_is_set_aside(r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    listener = Listener(r, keys, "poison", "other")
    submit(r, keys, "poison")
    limit = 3
    s = scheduler(redis_url, ns, poison_limit=limit)
    s._take_over()
    s._tick()  # read, and held when this leader dies
    for crash in range(limit - 1):
        s = scheduler(redis_url, ns, poison_limit=limit)
        s._take_over()
        assert "poison" in [q.request_id for q in s.queue]
        if crash == 0:
            submit(r, keys, "other")  # arrives later: fewer crashes count against it
            s._tick()
    assert listener.results() == []
    # Each leader died without a signal while "poison" was pending; the third take-over set it aside.
    s = scheduler(redis_url, ns, poison_limit=limit)
    s._take_over()
    assert [q.request_id for q in s.queue] == ["other"]
    letters = [fields[b"request_id"] for _, fields in r.xrange(keys.dead_letters)]
    assert letters == [b"poison"]
    [error] = listener.results()
    assert isinstance(error, Error) and error.code == ErrorCode.DEAD_LETTER
    assert int(r.get(keys.queued)) == 1


def test_leaders_that_stop_on_a_signal_blame_nothing(r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    submit(r, keys, "patient")
    for _ in range(5):
        s = scheduler(redis_url, ns, poison_limit=2, heartbeat_interval=0.05)
        s._take_over()
        s._tick()
        s.stopping = True
        s.run()  # returns at once, leaving the clean-exit mark
    s = scheduler(redis_url, ns, poison_limit=2)
    s._take_over()
    assert [q.request_id for q in s.queue] == ["patient"]
    assert r.xlen(keys.dead_letters) == 0


def test_a_worker_that_left_while_no_scheduler_led_is_found_by_its_keys(r: redis.Redis, redis_url: str,
                                                                       ns: str) -> None:
    """A worker that stops cleanly takes itself off the set of workers: a leader that never saw it finds it by its
    keys, moves what it held and removes them. What a scheduler writes to a worker's keys expires meanwhile."""
    keys = Keys(ns)
    held = Submit("held", SamplingParams(), prompt="hi")
    r.hset(keys.assigned("gone"), mapping={"held": encode(held, LIMIT)})
    r.xadd(keys.inbox("gone"), {PAYLOAD: b"x"})
    worker_beat(r, keys, "w1")
    s = scheduler(redis_url, ns)
    s._take_over()
    s._tick()
    s._tick()  # the moved request comes back through the stream, to the live worker
    assert not r.exists(keys.assigned("gone"), keys.inbox("gone"))
    [(_, batch)] = inbox_batches(r, keys, "w1")
    assert [(q.request_id, q.migrations) for q in batch.sequences] == [("held", 1)]
    assert 0 < r.ttl(keys.inbox("w1")) <= WORKER_KEYS_TTL_SECONDS
    assert 0 < r.ttl(keys.assigned("w1")) <= WORKER_KEYS_TTL_SECONDS


# Preempting the batch lane: a Yield to the worker, its Yielded back, the line queued again from its tokens.


def inbox_messages(r: redis.Redis, keys: Keys, worker_id: str) -> list[InboxMessage]:
    return [decode(fields[PAYLOAD], InboxMessage, LIMIT) for _, fields in r.xrange(keys.inbox(worker_id))]


def yields_asked(r: redis.Redis, keys: Keys, worker_id: str) -> list[list[str]]:
    return [m.request_ids for m in inbox_messages(r, keys, worker_id) if isinstance(m, Yield)]


def dispatched(r: redis.Redis, keys: Keys, worker_id: str) -> list[str]:
    return [q.request_id for m in inbox_messages(r, keys, worker_id) if isinstance(m, Batch) for q in m.sequences]


def hops(r: redis.Redis, keys: Keys, rid: str) -> list[str]:
    return [decode(raw, TraceEvent, LIMIT).hop for raw in r.lrange(keys.trace(rid), 0, -1)]


def lane_of_three(r: redis.Redis, redis_url: str, ns: str, **lines: dict) -> Scheduler:
    """A worker of 4 slots running `lines` (their Submit fields), dispatched in order: the lane's 3 at most."""
    keys = Keys(ns)
    s = scheduler(redis_url, ns, heartbeat_interval=0.4)
    s._take_over()
    worker_beat(r, keys, "w", slots=4)
    s.roster.next_refresh = 0
    for at, (rid, fields) in enumerate(lines.items()):
        submit(r, keys, rid, background=True, submitted_at=float(at), **fields)
    s._tick()
    return s


def test_a_surge_makes_the_latest_line_yield_and_it_comes_back_to_the_lane_with_its_tokens(
        r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    s = lane_of_three(r, redis_url, ns, line0={}, line1={}, line2={}, line3={})
    assert dispatched(r, keys, "w") == ["line0", "line1", "line2"]
    r.rpush(keys.progress("line2"), 5, 6, 7)  # what the worker delivered of it
    submit(r, keys, "chat-a", tenant="a", submitted_at=10.0)
    submit(r, keys, "chat-b", tenant="b", submitted_at=11.0)
    s._tick()  # chat-a takes the free slot; chat-b waits, so the latest line is asked for its slot
    assert dispatched(r, keys, "w")[3:] == ["chat-a"] and yields_asked(r, keys, "w") == [["line2"]]
    s._tick()
    assert yields_asked(r, keys, "w") == [["line2"]]  # asked once within the patience
    r.xadd(keys.events, {PAYLOAD: encode(Yielded("w", "line2"), LIMIT)})
    s._tick()  # its slot is chat-b's at once
    assert dispatched(r, keys, "w")[4:] == ["chat-b"]
    assert r.get(keys.owner("line2")) == b"" and not r.hexists(keys.assigned("w"), "line2")
    s._tick()  # the line is back from the stream, in the lane, ahead of the newer line3
    assert [(q.request_id, q.submit.resume, q.submit.yields, q.submit.migrations) for q in s.queue] == [
        ("line2", [5, 6, 7], 1, 0), ("line3", [], 0, 0)]
    queued = sum(len(encode(q.submit, LIMIT)) for q in s.queue)
    assert (int(r.get(keys.queued)), int(r.get(keys.queued_bytes))) == (2, queued)  # counted in again
    assert hops(r, keys, "line2")[-2:] == ["requeued", "queued"]


def test_a_line_at_the_yield_limit_is_not_asked_and_one_cancelled_while_asked_ends(
        r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    s = lane_of_three(r, redis_url, ns, fresh={}, tired={"yields": YIELD_LIMIT})
    for n in range(4):
        submit(r, keys, f"chat{n}", tenant=f"t{n}", submitted_at=10.0 + n)
    s._tick()  # two slots free, two more wanted: only the fresh line may yield
    assert yields_asked(r, keys, "w") == [["fresh"]] and s.roster.workers["w"].settled == {"tired"}
    r.rpush(keys.progress("fresh"), 1, 2)
    s.redis.xadd(keys.requests, {PAYLOAD: encode(Cancel("fresh"), LIMIT)})
    s._tick()  # the cancel goes on to the worker, which has handed the line back already
    assert isinstance(inbox_messages(r, keys, "w")[-1], Cancel)
    queued = int(r.get(keys.queued))
    r.xadd(keys.events, {PAYLOAD: encode(Yielded("w", "fresh"), LIMIT)})
    s._tick()
    s._tick()
    assert "fresh" not in [q.request_id for q in s.queue] and not r.exists(keys.progress("fresh"))
    assert int(r.get(keys.queued)) == queued - 1  # chat2 took its slot; nothing counted in
    assert not r.hexists(keys.assigned("w"), "fresh") and "fresh" not in s.roster.workers["w"].assigned


def test_assignments_their_worker_does_not_hold_move_on_unless_they_ended_or_were_freed(
        r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    s = scheduler(redis_url, ns)
    s._take_over()
    worker_beat(r, keys, "w", slots=4)
    s.roster.next_refresh = 0
    for rid in ("lost", "ended", "finished"):
        submit(r, keys, rid)
    s._tick()
    assert sorted(dispatched(r, keys, "w")) == ["ended", "finished", "lost"]
    r.rpush(keys.progress("lost"), 3, 4)  # "lost": its tokens delivered, then its writes since were dropped
    r.set(keys.owner("ended"), "")  # "ended": its ending's script ran, its Finished was dropped
    r.hset(keys.assigned("w"), "freed", encode(Submit("freed", SamplingParams()), LIMIT))  # its HDEL was dropped
    # "finished": its Finished is read just before the report that names it, its HDEL not yet written.
    for event in (Finished("w", "finished"), Unheld("w", ["lost", "ended", "finished", "freed"])):
        r.xadd(keys.events, {PAYLOAD: encode(event, LIMIT)})
    s._tick()
    assert r.hlen(keys.assigned("w")) == 0 and s.roster.workers["w"].assigned == {}
    assert r.get(keys.owner("lost")) == b"" and r.get(keys.owner("ended")) == b""
    s._tick()  # "lost" alone is back from the stream, and dispatched again
    [again] = [q for m in inbox_messages(r, keys, "w")[1:] if isinstance(m, Batch) for q in m.sequences]
    assert (again.request_id, again.resume, again.migrations) == ("lost", [3, 4], 1)
    assert list(s.roster.workers["w"].assigned) == ["lost"] and "migrated" in hops(r, keys, "lost")
    assert (int(r.get(keys.queued)), int(r.get(keys.queued_bytes))) == (0, 0)


def test_a_report_from_a_worker_not_seen_alive_is_left_to_its_loss(r: redis.Redis, redis_url: str, ns: str) -> None:
    keys = Keys(ns)
    s = scheduler(redis_url, ns)
    s._take_over()
    r.hset(keys.assigned("ghost"), "x", encode(Submit("x", SamplingParams()), LIMIT))
    r.xadd(keys.events, {PAYLOAD: encode(Unheld("ghost", ["x"]), LIMIT)})
    s._consume({keys.events: ">"}, block_ms=None)
    assert r.hexists(keys.assigned("ghost"), "x") and len(s.queue) == 0
