"""The scheduler process: consumes the request stream and worker events with one
consumer group, keeps the waiting queue, and sends each worker msgpack batches
up to its free slots.

Everything it must not lose lives in Redis, so a restarted (or standby) scheduler
picks up where the last one stopped: requests stay pending on the stream until
dispatched, each worker's assignments sit in a hash, and the tokens delivered
for each running request in a list. A lost worker's requests go back on the
stream with those tokens, to continue on another worker.

This module is the service's loop: taking over from a predecessor, consuming both streams, expiry and dispatch.
The leader lease and a predecessor's pending entries are scheduler/leadership.py's; the workers it sees and what
happens to a lost one (or to a batch line handed back), scheduler/roster.py's; what it writes of a request's fate,
scheduler/outcomes.py's; who runs next, and which batch lines yield their slots to interactive requests waiting,
scheduler/policy.py's."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
import uuid
from collections import Counter

import redis

from common.clients import sync_client
from common.counters import QueueCounts
from common.errors import ErrorCode
from common.keys import OWNER_TTL_SECONDS, PAYLOAD, SCHEDULER_GROUP, WORKER_KEYS_TTL_SECONDS, Keys
from common.protocol import (
    Batch,
    Cancel,
    Finished,
    Handoff,
    RequestMessage,
    Returned,
    Submit,
    Unheld,
    WorkerEvent,
    Yield,
    Yielded,
    encode,
    now,
)
from common.runtime import REDIS_ERRORS, Backoff, decode_or_drop, redis_trouble, service_id
from common.settings import SchedulerSettings
from common.streams import StreamWriter
from common.telemetry import serve_metrics, setup_logging
from common.tracing import Tracing
from scheduler import compat_metrics, metrics
from scheduler.leadership import CONSUMER, Leadership
from scheduler.outcomes import Outcomes
from scheduler.policy import (
    BATCH_OVERHEAD,
    PRIORITY_CLASSES,
    YIELD_LIMIT,
    YIELD_PATIENCE_BEATS,
    InteractivePeak,
    Queued,
    WaitingQueue,
    WorkerState,
    Yields,
    fits_a_batch,
    interactive_demand,
    model_figures,
    plan,
    priority_class,
)
from scheduler.roster import Roster

log = logging.getLogger("scheduler")


class Scheduler:
    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.tracing = Tracing("scheduler")
        self.keys = Keys(settings.namespace)
        self.redis = sync_client(settings.redis_url)
        self.limit = settings.max_message_bytes
        self.streams = StreamWriter(self.keys, self.limit)
        self.id = service_id()
        self.stopping = False
        self.outcomes = Outcomes(self.keys, settings)
        self.counts = QueueCounts(self.keys)
        self.leadership = Leadership(self.redis, self.keys, settings, self.outcomes, self.id)
        self._reset()

    def _reset(self) -> None:
        """Forget everything held in memory; `_take_over` rebuilds it from Redis."""
        self.leading = False
        self.queue = WaitingQueue(fair=self.settings.scheduling_policy == "fair")
        self.interactive = InteractivePeak()
        self.yields = Yields(YIELD_PATIENCE_BEATS * self.settings.heartbeat_interval)
        self.roster = Roster(self.redis, self.keys, self.settings, self.outcomes,
                             lambda: self._consume({self.keys.events: ">"}, block_ms=None))
        # A standby or a demoted leader shows no work: only the leader's gauges count.
        for gauge in (metrics.WAITING, metrics.WORKERS, metrics.FREE_SLOTS,
                      *(metrics.WAITING_BY_PRIORITY.labels(c) for c in PRIORITY_CLASSES)):
            gauge.set(0)
        compat_metrics.set_models({})

    def run(self) -> None:
        backoff = Backoff()
        while not self.stopping:
            try:
                if self.leadership.hold():
                    if not self.leading:
                        self._take_over()
                    self._tick()
                else:
                    if self.leading:
                        log.warning("lost the lease; standing by", extra={"scheduler": self.id})
                        self._reset()
                    time.sleep(self.settings.heartbeat_interval)
                backoff.reset()
            except REDIS_ERRORS as exc:
                if not redis_trouble(exc):
                    raise
                delay = backoff.next()
                log.warning("redis unreachable, restarted or full; retrying",
                            extra={"error": str(exc), "retry_in_s": delay})
                self._reset()
                time.sleep(delay)
        if self.leading:
            with contextlib.suppress(*REDIS_ERRORS):
                self.leadership.leave_clean()

    def _take_over(self) -> None:
        self._reset()
        claims = self.leadership.settle_pending()
        # Entries read by an earlier scheduler but never dispatched (or accounted) are still pending.
        cursors = {self.keys.requests: "0", self.keys.events: "0"}
        while cursors:
            replies = self._consume(cursors, block_ms=None)
            cursors = {stream.decode(): entries[-1][0] for stream, entries in replies if entries}
        self.leadership.claim(claims)
        self.leading = True
        log.info("scheduler leading", extra={"scheduler": self.id, "recovered": len(self.queue)})

    def _tick(self) -> None:
        self._consume({self.keys.requests: ">", self.keys.events: ">"},
                      block_ms=int(self.settings.heartbeat_interval * 1000))
        if now() >= self.roster.next_refresh:
            self.roster.refresh()
            self.roster.tend_keys()
            self._expire()
            self._publish_models()
        self._dispatch()
        metrics.WAITING.set(len(self.queue))
        waiting = Counter(priority_class(item.submit) for item in self.queue)
        for name in PRIORITY_CLASSES:
            metrics.WAITING_BY_PRIORITY.labels(name).set(waiting[name])
        metrics.WORKERS.set(len(self.roster.workers))
        metrics.FREE_SLOTS.set(sum(w.free for w in self.roster.workers.values()))

    def _consume(self, streams: dict[str, str | bytes], block_ms: int | None) -> list:
        """Read both streams; everything the entries cause goes to Redis in one pipeline. A failure
        while handling one entry sets that entry aside and fails its request, and nothing else."""
        replies = self.redis.xreadgroup(SCHEDULER_GROUP, CONSUMER, streams, count=512, block=block_ms)
        pipe = self.redis.pipeline(transaction=False)
        handoffs: list[str] = []
        for stream, entries in replies:
            if stream.decode() == self.keys.requests:
                for entry_id, fields in entries:
                    self._guarded(pipe, entry_id, fields or {})
            elif entries:
                for _entry_id, fields in entries:
                    self._on_event(pipe, fields or {}, handoffs)
                self.outcomes.ack(pipe, self.keys.events, [entry_id for entry_id, _ in entries])
        pipe.execute()
        # After the pipeline: a handed-off worker's requests that finished first must not move.
        for worker_id in handoffs:
            self.roster.workers.pop(worker_id, None)
            self.roster.lose(worker_id)
        return replies

    def _guarded(self, pipe: redis.client.Pipeline, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        message = decode_or_drop(fields.get(PAYLOAD), RequestMessage, self.limit, log, "a malformed request",
                                 entry=entry_id)
        try:
            if message is None:
                self.outcomes.ack(pipe, self.keys.requests, [entry_id])
            elif isinstance(message, Cancel):
                self.outcomes.ack(pipe, self.keys.requests, [entry_id])
                self._cancel(pipe, message)
            else:
                self._on_submit(pipe, Queued(message, entry_id, len(fields[PAYLOAD])))
        except Exception:
            log.exception("a request failed the scheduler; set aside", extra={"entry": entry_id})
            if isinstance(message, Submit):
                self.queue.remove(message.request_id)
                self.outcomes.dead_letter(pipe, message, "it raised in the scheduler")
                self.outcomes.leave_queue(pipe, [Queued(message, entry_id, len(fields[PAYLOAD]))])

    def _on_submit(self, pipe: redis.client.Pipeline, item: Queued) -> None:
        rid = item.request_id
        if not fits_a_batch(item.size, self.limit):
            self.outcomes.leave_queue(pipe, [item])
            self.outcomes.fail(pipe, rid, ErrorCode.REQUEST_TOO_LARGE,
                       f"the request is {item.size} bytes on the bus; at most {self.limit - BATCH_OVERHEAD} fit")
            return
        self.queue.add(item)
        self.outcomes.stamp(pipe, rid, "queued", waiting=len(self.queue), migrations=item.submit.migrations)
        log.info("queued", extra={"request_id": rid, "waiting": len(self.queue), "tenant": item.tenant,
                                  "migrations": item.submit.migrations})

    def _cancel(self, pipe: redis.client.Pipeline, cancel: Cancel) -> None:
        rid = cancel.request_id
        queued = self.queue.remove(rid)
        if queued:
            self.outcomes.leave_queue(pipe, [queued])
            self.outcomes.progress.forget(pipe, rid)
            self.outcomes.stamp(pipe, rid, "cancelled", where="queue")
            log.info("cancelled while queued", extra={"request_id": rid})
            return
        for worker in self.roster.workers.values():
            if rid in worker.assigned:
                if rid in self.yields.asked:  # its worker may hand it back before the cancel reaches it
                    self.yields.cancelled.add(rid)
                self.streams.inbox(pipe, worker.worker_id, cancel)
                log.info("cancel forwarded", extra={"request_id": rid, "worker_id": worker.worker_id})
                return

    def _on_event(self, pipe: redis.client.Pipeline, fields: dict[bytes, bytes], handoffs: list[str]) -> None:
        event = decode_or_drop(fields.get(PAYLOAD), WorkerEvent, self.limit, log, "a malformed worker event")
        if isinstance(event, Handoff):
            handoffs.append(event.worker_id)
        if isinstance(event, Returned):
            self._returned(pipe, event)
        if isinstance(event, Unheld):
            self.roster.reclaim(pipe, event.worker_id, event.request_ids)
        if isinstance(event, Yielded):
            self.roster.take_back(pipe, event.worker_id, event.request_id,
                                  cancelled=event.request_id in self.yields.cancelled)
            self.yields.cancelled.discard(event.request_id)
        if not isinstance(event, Finished | Returned):
            return
        pipe.hdel(self.keys.assigned(event.worker_id), event.request_id)
        worker = self.roster.workers.get(event.worker_id)
        if worker:
            worker.assigned.pop(event.request_id, None)
            worker.settled.discard(event.request_id)
        self.roster.model_of.pop(event.request_id, None)

    def _returned(self, pipe: redis.client.Pipeline, event: Returned) -> None:
        """A worker refused a request for a model it does not serve: queued again as it was, counted in again
        (it left the admission counts at dispatch), and that worker is not asked again for that model."""
        payload = self.redis.hget(self.keys.assigned(event.worker_id), event.request_id)
        submit = decode_or_drop(payload, Submit, self.limit, log, "a returned assignment",
                                worker_id=event.worker_id)
        if submit is None:
            return
        log.warning("returned by its worker", extra={"request_id": submit.request_id, "model": submit.model,
                                                     "worker_id": event.worker_id, "reason": event.reason})
        worker = self.roster.workers.get(event.worker_id)
        if worker is not None and submit.model:
            worker.models = worker.models - {submit.model} or frozenset({""})
        if not submit.migrations:
            self.counts.count_in(pipe, 1, len(payload))
        self.streams.request(pipe, payload)

    def _publish_models(self) -> None:
        """Each model's requests waiting and running, for the metrics and, through Redis, for each gateway's
        /health?model= (what an autoscaler of that model's workers reads). Models with workers but no work
        show zeros."""
        figures = model_figures(self.queue.depths(), Counter(self.roster.model_of.values()),
                                [w.models for w in self.roster.workers.values()])
        compat_metrics.set_models(figures)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.models)
        if figures:
            pipe.hset(self.keys.models, mapping={model: encode(f, self.limit) for model, f in figures.items()})
            pipe.pexpire(self.keys.models, int(self.settings.worker_ttl * 1000))
        pipe.execute()

    def _expire(self) -> None:
        """Requests that waited past their deadline leave the queue with a timeout error."""
        clock = now()
        expired = self.queue.expired(clock)
        if not expired:
            return
        pipe = self.redis.pipeline(transaction=False)
        self.outcomes.leave_queue(pipe, expired)
        for item in expired:
            waited = clock - item.submit.submitted_at
            metrics.QUEUE_TIMEOUTS.inc()
            self.outcomes.fail(pipe, item.request_id, ErrorCode.QUEUE_TIMEOUT,
                       f"no worker took the request within {waited:.1f} s")
        pipe.execute()

    def _dispatch(self) -> None:
        workers, clock = list(self.roster.workers.values()), now()
        reserved = self.interactive.note(clock, interactive_demand(self.queue, workers))
        if not self.queue:
            return
        batches = plan(self.queue, workers, self.limit, clock, reserved)
        if batches:
            self._send(batches, clock)
        self._preempt(workers, clock)

    def _preempt(self, workers: list[WorkerState], clock: float) -> None:
        """Interactive requests still waiting past the free slots: the latest batch lines dispatched hand theirs
        back, each worker asked in one Yield (scheduler/policy.py's Yields says which, and when to ask again); they
        come back as Yielded events (`Roster.take_back`)."""
        asks = self.yields.ask(self.queue, workers, clock)
        if not asks:
            return
        pipe = self.redis.pipeline(transaction=False)
        for worker_id, request_ids in asks.items():
            self.streams.inbox(pipe, worker_id, Yield(request_ids))
            log.info("asked to yield", extra={"worker_id": worker_id, "requests": len(request_ids),
                                              "waiting": self.queue.interactive()})
        pipe.execute()

    def _send(self, batches: list[tuple[str, list[Queued]]], clock: float) -> None:
        # Each request's owner first, in a round trip of its own: a worker must never read a request in its inbox
        # before Redis knows the request is its to write (in a cluster the two keys live on different nodes).
        owners = self.redis.pipeline(transaction=False)
        for worker_id, items in batches:
            for item in items:
                owners.set(self.keys.owner(item.request_id), worker_id, ex=OWNER_TTL_SECONDS)
        owners.execute()
        pipe = self.redis.pipeline(transaction=False)
        self.outcomes.leave_queue(pipe, [item for _, batch in batches for item in batch])
        for worker_id, items in batches:
            batch = Batch(uuid.uuid4().hex[:12], [item.submit for item in items])
            pipe.hset(self.keys.assigned(worker_id),
                      mapping={item.request_id: encode(item.submit, self.limit) for item in items})
            self.streams.inbox(pipe, worker_id, batch)
            pipe.expire(self.keys.assigned(worker_id), WORKER_KEYS_TTL_SECONDS)
            metrics.BATCHES.inc()
            for item in items:
                self.roster.workers[worker_id].assigned[item.request_id] = item.tenant
                if item.submit.background and item.submit.yields >= YIELD_LIMIT:
                    self.roster.workers[worker_id].settled.add(item.request_id)
                self.roster.model_of[item.request_id] = item.model
                self.outcomes.stamp(pipe, item.request_id, "dispatched", batch_id=batch.batch_id, worker_id=worker_id,
                            batch_size=len(items), model=item.model)
                metrics.DISPATCH_LATENCY.observe(max(clock - item.submit.submitted_at, 0.0))
                metrics.QUEUE_WAIT.labels(priority_class(item.submit)).observe(
                    max(clock - item.submit.submitted_at, 0.0))
                self.tracing.end(self.tracing.start(
                    "llmserve.queue", item.submit.traceparent, int(item.submit.submitted_at * 1e9),
                    **{"llmserve.request_id": item.request_id, "llmserve.worker_id": worker_id,
                       "llmserve.batch_id": batch.batch_id, "llmserve.batch_size": len(items),
                       "llmserve.migrations": item.submit.migrations}))
                log.info("dispatched", extra={"request_id": item.request_id, "batch_id": batch.batch_id,
                                              "worker_id": worker_id})
            metrics.DISPATCHED.inc(len(items))
        pipe.execute()


def main() -> None:
    settings = SchedulerSettings.from_env()
    setup_logging("scheduler", settings.log_level)
    serve_metrics(settings.scheduler_metrics_port, "scheduler")
    scheduler = Scheduler(settings)

    def stop(_signum: int, _frame: object) -> None:
        scheduler.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    scheduler.run()
