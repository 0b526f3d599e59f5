"""The scheduler process: consumes the request stream and worker events with one
consumer group, keeps the waiting queue, and sends each worker msgpack batches
up to its free slots.

Everything it must not lose lives in Redis, so a restarted (or standby) scheduler
picks up where the last one stopped: requests stay pending on the stream until
dispatched, each worker's assignments sit in a hash, and the tokens delivered
for each running request in a list. A lost worker's requests go back on the
stream with those tokens, to continue on another worker."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections import deque

import redis

from common.protocol import (
    PAYLOAD,
    SCHEDULER_GROUP,
    Batch,
    Cancel,
    Error,
    Finished,
    Heartbeat,
    Keys,
    ProtocolError,
    RequestMessage,
    Submit,
    decode,
    encode,
    now,
)
from common.settings import Settings
from common.telemetry import serve_metrics, setup_logging
from common.trace import stamp
from scheduler import metrics
from scheduler.batcher import WorkerState, plan

log = logging.getLogger("scheduler")

# One consumer name for every replica: a new leader reads its predecessor's pending entries.
CONSUMER = "scheduler"
STREAM_MAXLEN = 100_000
MAX_BACKOFF = 5.0

# Take the lease if it is free, or extend it if it is ours. KEYS: lease. ARGV: our id, ttl ms.
_LEASE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""


class Scheduler:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.lease_script = self.redis.register_script(_LEASE)
        self.limit = settings.max_message_bytes
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stopping = False
        self._reset()

    def _reset(self) -> None:
        """Forget everything held in memory; `_take_over` rebuilds it from Redis."""
        self.leading = False
        self.waiting: deque[Submit] = deque()
        self.entry_of: dict[str, bytes] = {}  # request_id -> its stream entry, acked once it leaves the queue
        self.workers: dict[str, WorkerState] = {}
        self.next_refresh = 0.0

    def run(self) -> None:
        backoff = 0.1
        while not self.stopping:
            try:
                if self._hold_lease():
                    if not self.leading:
                        self._take_over()
                    self._tick()
                else:
                    if self.leading:
                        log.warning("lost the lease; standing by", extra={"scheduler": self.id})
                        self._reset()
                    time.sleep(self.settings.heartbeat_interval)
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                # NOGROUP: Redis came back empty between two calls; anything else is unexpected.
                if isinstance(exc, redis.ResponseError) and "NOGROUP" not in str(exc):
                    raise
                log.warning("redis unreachable or restarted; retrying", extra={"error": str(exc),
                                                                              "retry_in_s": backoff})
                self._reset()
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _hold_lease(self) -> bool:
        return bool(self.lease_script(keys=[self.keys.lease], args=[self.id, int(self.settings.worker_ttl * 1000)]))

    def _take_over(self) -> None:
        self._reset()
        for stream in (self.keys.requests, self.keys.events):
            try:
                self.redis.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        # Entries read by an earlier scheduler but never dispatched (or accounted) are still pending.
        cursors = {self.keys.requests: "0", self.keys.events: "0"}
        while cursors:
            replies = self._consume(cursors, block_ms=None)
            cursors = {stream.decode(): entries[-1][0] for stream, entries in replies if entries}
        self.leading = True
        log.info("scheduler leading", extra={"scheduler": self.id, "recovered": len(self.waiting)})

    def _tick(self) -> None:
        self._consume({self.keys.requests: ">", self.keys.events: ">"},
                      block_ms=int(self.settings.heartbeat_interval * 1000))
        if now() >= self.next_refresh:
            self._refresh_workers()
            self._expire()
        self._dispatch()
        metrics.WAITING.set(len(self.waiting))
        metrics.WORKERS.set(len(self.workers))
        metrics.FREE_SLOTS.set(sum(w.free for w in self.workers.values()))

    def _consume(self, streams: dict[str, str | bytes], block_ms: int | None) -> list:
        """Read both streams; everything the entries cause goes to Redis in one pipeline."""
        replies = self.redis.xreadgroup(SCHEDULER_GROUP, CONSUMER, streams, count=512, block=block_ms)
        pipe = self.redis.pipeline(transaction=False)
        for stream, entries in replies:
            if stream.decode() == self.keys.requests:
                for entry_id, fields in entries:
                    self._on_request(pipe, entry_id, fields or {})
            elif entries:
                for _entry_id, fields in entries:
                    self._on_event(pipe, fields or {})
                pipe.xack(self.keys.events, SCHEDULER_GROUP, *(entry_id for entry_id, _ in entries))
        pipe.execute()
        return replies

    def _stamp(self, pipe: redis.client.Pipeline, request_id: str, hop: str, **detail: str | int | float) -> None:
        stamp(pipe, self.keys, request_id, hop, "scheduler", self.settings.trace_ttl, **detail)

    def _on_request(self, pipe: redis.client.Pipeline, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            message = decode(fields[PAYLOAD], RequestMessage, self.limit)
        except (ProtocolError, KeyError) as exc:
            log.error("dropped a malformed request", extra={"entry": entry_id, "error": str(exc)})
            pipe.xack(self.keys.requests, SCHEDULER_GROUP, entry_id)
            return
        if isinstance(message, Cancel):
            pipe.xack(self.keys.requests, SCHEDULER_GROUP, entry_id)
            self._cancel(pipe, message)
            return
        self.entry_of[message.request_id] = entry_id
        if message.migrations:
            self.waiting.appendleft(message)  # it was running: it goes first
        else:
            self.waiting.append(message)
        self._stamp(pipe, message.request_id, "queued", waiting=len(self.waiting), migrations=message.migrations)
        log.info("queued", extra={"request_id": message.request_id, "waiting": len(self.waiting),
                                  "migrations": message.migrations})

    def _cancel(self, pipe: redis.client.Pipeline, cancel: Cancel) -> None:
        rid = cancel.request_id
        for submit in self.waiting:
            if submit.request_id == rid:
                self.waiting.remove(submit)
                self._leave_queue(pipe, [submit])
                pipe.delete(self.keys.progress(rid))
                self._stamp(pipe, rid, "cancelled", where="queue")
                log.info("cancelled while queued", extra={"request_id": rid})
                return
        for worker in self.workers.values():
            if rid in worker.assigned:
                pipe.xadd(self.keys.inbox(worker.worker_id), {PAYLOAD: encode(cancel, self.limit)})
                log.info("cancel forwarded", extra={"request_id": rid, "worker_id": worker.worker_id})
                return

    def _on_event(self, pipe: redis.client.Pipeline, fields: dict[bytes, bytes]) -> None:
        try:
            event = decode(fields[PAYLOAD], Finished, self.limit)
        except (ProtocolError, KeyError) as exc:
            log.error("dropped a malformed worker event", extra={"error": str(exc)})
            return
        pipe.hdel(self.keys.assigned(event.worker_id), event.request_id)
        worker = self.workers.get(event.worker_id)
        if worker:
            worker.assigned.discard(event.request_id)

    def _refresh_workers(self) -> None:
        self.next_refresh = now() + self.settings.heartbeat_interval
        ids = sorted(member.decode() for member in self.redis.smembers(self.keys.workers))
        beats = self.redis.mget([self.keys.heartbeat(i) for i in ids]) if ids else []
        alive: dict[str, WorkerState] = {}
        for worker_id, raw in zip(ids, beats, strict=True):
            beat = self._heartbeat(worker_id, raw)
            if beat is None:
                self._lose(worker_id)
                continue
            state = self.workers.get(worker_id)
            if state is None:
                known = {rid.decode() for rid in self.redis.hkeys(self.keys.assigned(worker_id))}
                state = WorkerState(worker_id, beat.slots, known)
                log.info("worker joined", extra={"worker_id": worker_id, "slots": beat.slots, "running": len(known)})
            state.draining = beat.draining
            alive[worker_id] = state
        for worker_id in self.workers.keys() - alive.keys() - set(ids):
            self._lose(worker_id)
        self.workers = alive

    def _heartbeat(self, worker_id: str, raw: bytes | None) -> Heartbeat | None:
        if raw is None:
            return None
        try:
            return decode(raw, Heartbeat, self.limit)
        except ProtocolError as exc:
            log.error("bad heartbeat", extra={"worker_id": worker_id, "error": str(exc)})
            return None

    def _lose(self, worker_id: str) -> None:
        """Put the requests of a worker that is gone back on the stream, each with the tokens it
        has already delivered, or end them with an error past the migration limit."""
        assigned = self.redis.hgetall(self.keys.assigned(worker_id))
        if assigned:
            metrics.WORKERS_LOST.inc()
        level = logging.WARNING if assigned else logging.INFO
        log.log(level, "worker gone", extra={"worker_id": worker_id, "in_flight": len(assigned)})
        reads = self.redis.pipeline(transaction=False)
        for rid in assigned:
            reads.lrange(self.keys.progress(rid.decode()), 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for payload, delivered in zip(assigned.values(), reads.execute(), strict=True):
            try:
                submit = decode(payload, Submit, self.limit)
            except ProtocolError:
                continue
            self._migrate(pipe, submit, [int(t) for t in delivered])
        pipe.delete(self.keys.assigned(worker_id), self.keys.inbox(worker_id))
        pipe.srem(self.keys.workers, worker_id)
        pipe.execute()

    def _migrate(self, pipe: redis.client.Pipeline, submit: Submit, delivered: list[int]) -> None:
        rid = submit.request_id
        if submit.migrations >= self.settings.migration_limit:
            log.error("migration limit reached", extra={"request_id": rid, "migrations": submit.migrations})
            error = Error("migration_limit", f"the request lost its worker {submit.migrations + 1} times")
            pipe.publish(self.keys.results(rid), encode(error, self.limit))
            pipe.delete(self.keys.progress(rid))
            metrics.MIGRATION_FAILURES.inc()
            return
        submit.resume = delivered
        submit.migrations += 1
        metrics.MIGRATIONS.inc()
        self._stamp(pipe, rid, "migrated", resume_tokens=len(delivered), migrations=submit.migrations)
        log.warning("migrating", extra={"request_id": rid, "resume_tokens": len(delivered),
                                        "migrations": submit.migrations})
        pipe.xadd(self.keys.requests, {PAYLOAD: encode(submit, self.limit)}, maxlen=STREAM_MAXLEN, approximate=True)

    def _expire(self) -> None:
        """Requests that waited past their deadline leave the queue with a timeout error."""
        clock = now()
        expired = [s for s in self.waiting if s.deadline and s.deadline < clock]
        if not expired:
            return
        self.waiting = deque(s for s in self.waiting if s not in expired)
        pipe = self.redis.pipeline(transaction=False)
        self._leave_queue(pipe, expired)
        for submit in expired:
            waited = clock - submit.submitted_at
            log.warning("timed out in the queue", extra={"request_id": submit.request_id, "waited_s": waited})
            message = Error("queue_timeout", f"no worker took the request within {waited:.1f} s")
            pipe.publish(self.keys.results(submit.request_id), encode(message, self.limit))
            self._stamp(pipe, submit.request_id, "timed_out", waited_s=round(waited, 3))
            metrics.QUEUE_TIMEOUTS.inc()
        pipe.execute()

    def _leave_queue(self, pipe: redis.client.Pipeline, submits: list[Submit]) -> None:
        """Requests off the waiting queue: their stream entries are done, and the admission count
        drops for those the gateway counted in (not those re-queued after a worker loss)."""
        pipe.xack(self.keys.requests, SCHEDULER_GROUP, *(self.entry_of.pop(s.request_id) for s in submits))
        admitted = sum(1 for s in submits if not s.migrations)
        if admitted:
            pipe.decrby(self.keys.queued, admitted)

    def _dispatch(self) -> None:
        if not self.waiting:
            return
        batches = plan(self.waiting, list(self.workers.values()))
        if not batches:
            return
        pipe = self.redis.pipeline(transaction=False)
        self._leave_queue(pipe, [submit for sequences in batches.values() for submit in sequences])
        clock = now()
        for worker_id, sequences in batches.items():
            batch = Batch(uuid.uuid4().hex[:12], sequences)
            pipe.hset(self.keys.assigned(worker_id),
                      mapping={s.request_id: encode(s, self.limit) for s in sequences})
            pipe.xadd(self.keys.inbox(worker_id), {PAYLOAD: encode(batch, self.limit)},
                      maxlen=10_000, approximate=True)
            metrics.BATCHES.inc()
            for submit in sequences:
                self.workers[worker_id].assigned.add(submit.request_id)
                self._stamp(pipe, submit.request_id, "dispatched", batch_id=batch.batch_id, worker_id=worker_id,
                            batch_size=len(sequences))
                metrics.DISPATCH_LATENCY.observe(max(clock - submit.submitted_at, 0.0))
                log.info("dispatched", extra={"request_id": submit.request_id, "batch_id": batch.batch_id,
                                              "worker_id": worker_id})
            metrics.DISPATCHED.inc(len(sequences))
        pipe.execute()


def main() -> None:
    settings = Settings.from_env()
    setup_logging("scheduler", settings.log_level)
    serve_metrics(settings.scheduler_metrics_port, "scheduler")
    scheduler = Scheduler(settings)

    def stop(_signum: int, _frame: object) -> None:
        scheduler.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    scheduler.run()
