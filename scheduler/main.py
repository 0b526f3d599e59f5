"""The scheduler process: consumes the request stream and worker events with one
consumer group, keeps the waiting queue, and sends each worker msgpack batches
up to its free slots."""

from __future__ import annotations

import logging
import signal
import uuid
from collections import deque

import redis

from common.logs import setup_logging
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
from scheduler.batcher import WorkerState, plan

log = logging.getLogger("scheduler")

CONSUMER = "scheduler"


class Scheduler:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.limit = settings.max_message_bytes
        self.waiting: deque[Submit] = deque()
        self.entry_of: dict[str, bytes] = {}  # request_id -> its stream entry, acked once dispatched
        self.workers: dict[str, WorkerState] = {}
        self.next_refresh = 0.0
        self.stopping = False

    def run(self) -> None:
        for stream in (self.keys.requests, self.keys.events):
            try:
                self.redis.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        # Entries read before a restart but never dispatched are still pending: take them first.
        self._consume({self.keys.requests: "0"}, block_ms=None)
        log.info("scheduler ready", extra={"recovered": len(self.waiting)})
        while not self.stopping:
            self._consume({self.keys.requests: ">", self.keys.events: ">"},
                          block_ms=int(self.settings.heartbeat_interval * 1000))
            if now() >= self.next_refresh:
                self._refresh_workers()
                self._expire()
            self._dispatch()

    def _consume(self, streams: dict[str, str], block_ms: int | None) -> None:
        replies = self.redis.xreadgroup(SCHEDULER_GROUP, CONSUMER, streams, count=512, block=block_ms)
        for stream, entries in replies:
            if stream.decode() == self.keys.requests:
                for entry_id, fields in entries:
                    self._on_request(entry_id, fields or {})
            else:
                for _entry_id, fields in entries:
                    self._on_event(fields or {})
                self.redis.xack(self.keys.events, SCHEDULER_GROUP, *(entry_id for entry_id, _ in entries))

    def _on_request(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            message = decode(fields[PAYLOAD], RequestMessage, self.limit)
        except (ProtocolError, KeyError) as exc:
            log.error("dropped a malformed request", extra={"entry": entry_id, "error": str(exc)})
            self.redis.xack(self.keys.requests, SCHEDULER_GROUP, entry_id)
            return
        if isinstance(message, Submit):
            log.info("queued", extra={"request_id": message.request_id, "waiting": len(self.waiting) + 1})
            self.waiting.append(message)
            self.entry_of[message.request_id] = entry_id
        else:
            self.redis.xack(self.keys.requests, SCHEDULER_GROUP, entry_id)
            self._cancel(message)

    def _cancel(self, cancel: Cancel) -> None:
        rid = cancel.request_id
        for submit in self.waiting:
            if submit.request_id == rid:
                self.waiting.remove(submit)
                pipe = self.redis.pipeline(transaction=False)
                self._leave_queue(pipe, [submit])
                pipe.execute()
                log.info("cancelled while queued", extra={"request_id": rid})
                return
        for worker in self.workers.values():
            if rid in worker.assigned:
                self.redis.xadd(self.keys.inbox(worker.worker_id), {PAYLOAD: encode(cancel, self.limit)})
                log.info("cancel forwarded", extra={"request_id": rid, "worker_id": worker.worker_id})
                return

    def _on_event(self, fields: dict[bytes, bytes]) -> None:
        try:
            event = decode(fields[PAYLOAD], Finished, self.limit)
        except (ProtocolError, KeyError) as exc:
            log.error("dropped a malformed worker event", extra={"error": str(exc)})
            return
        worker = self.workers.get(event.worker_id)
        if worker:
            worker.assigned.discard(event.request_id)

    def _refresh_workers(self) -> None:
        self.next_refresh = now() + self.settings.heartbeat_interval
        ids = sorted(member.decode() for member in self.redis.smembers(self.keys.workers))
        beats = self.redis.mget([self.keys.heartbeat(i) for i in ids]) if ids else []
        alive = {}
        for worker_id, raw in zip(ids, beats, strict=True):
            if raw is None:
                continue
            try:
                beat = decode(raw, Heartbeat, self.limit)
            except ProtocolError as exc:
                log.error("bad heartbeat", extra={"worker_id": worker_id, "error": str(exc)})
                continue
            alive[worker_id] = self.workers.get(worker_id) or WorkerState(worker_id, beat.slots)
            if worker_id not in self.workers:
                log.info("worker joined", extra={"worker_id": worker_id, "slots": beat.slots})
        for worker_id in self.workers.keys() - alive.keys():
            self._lose(self.workers[worker_id])
        self.workers = alive

    def _lose(self, worker: WorkerState) -> None:
        log.warning("worker lost", extra={"worker_id": worker.worker_id, "in_flight": len(worker.assigned)})
        self.redis.srem(self.keys.workers, worker.worker_id)
        message = encode(Error("worker_lost", "the worker serving this request stopped"), self.limit)
        pipe = self.redis.pipeline(transaction=False)
        for rid in worker.assigned:
            pipe.publish(self.keys.results(rid), message)
        pipe.delete(self.keys.inbox(worker.worker_id))
        pipe.execute()

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
        pipe.execute()

    def _leave_queue(self, pipe: redis.client.Pipeline, submits: list[Submit]) -> None:
        """Requests off the waiting queue: their stream entries are done and the admission count drops."""
        pipe.xack(self.keys.requests, SCHEDULER_GROUP, *(self.entry_of.pop(s.request_id) for s in submits))
        pipe.decrby(self.keys.queued, len(submits))

    def _dispatch(self) -> None:
        if not self.waiting:
            return
        batches = plan(self.waiting, list(self.workers.values()))
        if not batches:
            return
        pipe = self.redis.pipeline(transaction=False)
        self._leave_queue(pipe, [submit for sequences in batches.values() for submit in sequences])
        for worker_id, sequences in batches.items():
            batch = Batch(uuid.uuid4().hex[:12], sequences)
            pipe.xadd(self.keys.inbox(worker_id), {PAYLOAD: encode(batch, self.limit)},
                      maxlen=10_000, approximate=True)
            for submit in sequences:
                self.workers[worker_id].assigned.add(submit.request_id)
                log.info("dispatched", extra={"request_id": submit.request_id, "batch_id": batch.batch_id,
                                              "worker_id": worker_id})
        pipe.execute()


def main() -> None:
    settings = Settings.from_env()
    setup_logging("scheduler", settings.log_level)
    scheduler = Scheduler(settings)

    def stop(_signum: int, _frame: object) -> None:
        scheduler.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    scheduler.run()
