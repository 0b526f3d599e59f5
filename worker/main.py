"""The worker process: reads batches from its inbox, steps the engine, publishes
each request's tagged results and tells the scheduler when a slot frees up."""

from __future__ import annotations

import contextlib
import logging
import signal
import time

import redis

from common.clients import sync_client
from common.errors import ErrorCode
from common.journey import stamp
from common.keys import Keys
from common.prefix_keys import prefix_keys
from common.progress import Progress
from common.protocol import (
    Batch,
    Cancel,
    Done,
    Error,
    Finished,
    Handoff,
    Heartbeat,
    Returned,
    Submit,
    Token,
    Yield,
    Yielded,
    encode,
    now,
)
from common.resultlog import publish_results, refused
from common.runtime import REDIS_ERRORS, Backoff, parse_heartbeats, redis_trouble, service_id
from common.settings import WorkerSettings
from common.streams import StreamWriter
from common.telemetry import serve_metrics, setup_logging
from common.tracing import Tracing
from worker import compat_metrics, engines, metrics
from worker.core import Engine, GrammarError, Model, PromptInvalid, PromptTooLong, StepOutput, StepResult
from worker.heartbeat import Heartbeats
from worker.inbox import Inbox
from worker.output import delivered_reason
from worker.ownership import Audit, standing
from worker.timing import Timing

log = logging.getLogger("worker")

class Worker:
    def __init__(self, settings: WorkerSettings, loaded: Model, engine: Engine) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.streams = StreamWriter(self.keys, settings.max_message_bytes)
        self.progress = Progress(self.keys)
        self.redis = sync_client(settings.redis_url)
        self.id = service_id()
        self.loaded = loaded
        self.engine = engine
        self.inbox = Inbox(self.redis, self.keys, self.id, settings)
        self.finished_total = 0
        self.drain_until: float | None = None  # set by SIGTERM
        self.handing_off: bool | None = None  # decided once, when the loop sees the drain
        self.stopping = False  # set by a second signal: leave now
        self.orphans: list[str] = []  # requests dropped while Redis was unreachable
        self.timings: dict[str, Timing] = {}
        self.metrics_port = 0
        self.tracing = Tracing("worker")
        self.names = settings.served_names()  # the model names it answers to
        self.heartbeats = Heartbeats(self.redis, self.keys, settings, self.id, self._heartbeat)
        self.audit = Audit(settings.worker_ttl)

    def drain(self) -> None:
        """Take no new work and stop: at once, handing what runs to other workers when they have room
        for it all (DRAIN_MODE=auto), else after finishing it (up to DRAIN_TIMEOUT; what is left then
        moves like the work of a lost worker). Runs in a signal handler: the loop decides which."""
        if self.drain_until is not None:
            self.stopping = True
            return
        self.drain_until = now() + self.settings.drain_timeout
        self.heartbeats.soon()  # tell the scheduler at once
        log.info("draining", extra={"worker_id": self.id, "running": self.engine.running_count})

    def _others_have_room(self) -> bool:
        """Whether the other live workers, not draining themselves, have free slots for all we hold."""
        ids = [m.decode() for m in self.redis.smembers(self.keys.workers) if m.decode() != self.id]
        beats = parse_heartbeats(ids, self.redis.mget([self.keys.heartbeat(i) for i in ids]) if ids else [],
                                 self.settings.max_message_bytes, log)
        room = sum(b.slots - b.running - b.waiting for b in beats.values() if b and not b.draining)
        return room >= self.engine.running_count + self.engine.waiting_count

    def run(self) -> None:
        log.info("worker ready", extra={"worker_id": self.id, "model": self.loaded.name, "names": self.names,
                                        "weights": self.loaded.weights, "slots": self.engine.slots})
        self.heartbeats.start()
        backoff = Backoff()
        while not self._done():
            try:
                self._tend()
                backoff.reset()
            except REDIS_ERRORS as exc:
                if not redis_trouble(exc):
                    raise
                self._lose_redis(exc, backoff.next())
        self.heartbeats.stop()
        with contextlib.suppress(*REDIS_ERRORS):
            self.redis.srem(self.keys.workers, self.id)
            self.redis.delete(self.keys.heartbeat(self.id))
            if self.handing_off and self.engine.has_work():
                self.streams.event(self.redis, Handoff(self.id))
        log.info("worker stopped", extra={"worker_id": self.id, "left_running": self.engine.running_count,
                                          "handed_off": self.handing_off})

    def _done(self) -> bool:
        if self.stopping:
            return True
        if self.drain_until is None:
            return False
        if self.handing_off is None:
            try:
                self.handing_off = self.settings.drain_mode == "auto" and self._others_have_room()
            except REDIS_ERRORS:
                self.handing_off = False
            log.info("drain", extra={"worker_id": self.id, "hand_off": self.handing_off})
        return self.handing_off or not self.engine.has_work() or now() > self.drain_until

    def _tend(self) -> None:
        if self.orphans:
            self._fail_orphans()
        self._read_inbox(block=not self.engine.has_work())
        self._step()
        if self.audit.due(now()):  # the requests dropped on a lost Redis are failed, and released, apart
            self.audit.report(self.redis, self.streams, self.id, self.engine.request_ids() | set(self.orphans))

    def _fail_orphans(self) -> None:
        """Tell each dropped request's client, once each: in a cluster that lost a node, some clients can be
        told while others' slots still have no node. Raises the last failure, so that the loop backs off."""
        left, trouble = [], None
        for request_id in self.orphans:
            try:
                self._fail(request_id, ErrorCode.REDIS_UNAVAILABLE, "the worker lost Redis while generating")
            except REDIS_ERRORS as exc:
                left.append(request_id)
                trouble = exc
        self.orphans = left
        if trouble is not None:
            raise trouble

    def _lose_redis(self, exc: Exception, backoff: float) -> None:
        """Whatever was in flight cannot be delivered in order any more: drop it, and tell its
        clients once Redis answers again (after a restart nobody listens, which is harmless)."""
        dropped = self.engine.abort_all()
        self.orphans += dropped
        log.warning("redis unreachable; retrying", extra={"worker_id": self.id, "error": str(exc),
                                                          "dropped": len(dropped), "retry_in_s": backoff})
        self.heartbeats.soon()
        time.sleep(backoff)

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(self.id, self.loaded.name, self.loaded.max_length, self.engine.slots,
                         self.engine.running_count, self.engine.waiting_count, self.finished_total, now(),
                         draining=self.drain_until is not None, metrics_port=self.metrics_port,
                         vocab=self.loaded.vocab, prefixes=self._held_prefixes(), engine=self.engine.name,
                         names=self.names, weights=self.loaded.weights)

    def _held_prefixes(self) -> list[int]:
        """The cache report; when it fails, the heartbeat goes without it (routing only loses a hint)."""
        try:
            return self.engine.routing.held() if self.engine.routing is not None else []
        except Exception:
            metrics.HEARTBEAT_ERRORS.labels("internal").inc()
            log.exception("prefix report failed", extra={"worker_id": self.id})
            return []

    def _read_inbox(self, block: bool) -> None:
        for message in self.inbox.read(int(self.settings.heartbeat_interval * 1000) if block else None):
            if isinstance(message, Batch):
                self._admit(message)
            elif isinstance(message, Cancel):
                self._cancel(message)
            elif isinstance(message, Yield):
                self._yield(message)
            else:  # a gateway's /tokenize or /detokenize
                self.inbox.answer(self.loaded, message)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            result = self.engine.step()
        except Exception:
            # A failed forward (out of memory, a bad model) must not take the worker down nor leave
            # streams hanging: every sequence in the engine gets an error and the engine starts afresh.
            log.exception("engine step failed", extra={"worker_id": self.id})
            for request_id in self.engine.abort_all():
                self._fail(request_id, ErrorCode.ENGINE_ERROR, "the worker failed while generating")
            return
        elapsed = time.perf_counter() - started
        if result.kind != "idle":  # a prefill step may end no prompt yet (chunked prefill): it counts too
            metrics.STEP_SECONDS.labels(result.kind).observe(elapsed)
        if result.outputs:
            if result.kind in ("decode", "mixed"):
                metrics.BATCH_SIZE.observe(len(result.outputs))
            metrics.TOKENS.inc(len(result.outputs))
        metrics.RUNNING.set(self.engine.running_count)
        metrics.WAITING.set(self.engine.waiting_count)
        metrics.KV_CACHE_TOKENS.set(self.engine.cache_positions)
        compat_metrics.observe_step(self.names[0], self.engine, self.engine.slots, self.loaded.max_length)
        self._publish(result, elapsed)

    def _admit(self, batch: Batch) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for submit in batch.sequences:
            if submit.model and submit.model not in self.names:
                self._return(pipe, submit)
                continue
            span = self.tracing.start("llmserve.generate", submit.traceparent, **{
                "llmserve.request_id": submit.request_id, "llmserve.worker_id": self.id,
                "llmserve.resume_tokens": len(submit.resume)})
            self.timings[submit.request_id] = Timing(max(now() - submit.submitted_at, 0.0), span=span)
            self._stamp(pipe, submit.request_id, "admitted", batch_id=batch.batch_id,
                        resume_tokens=len(submit.resume))
            log.info("admitted", extra={"request_id": submit.request_id, "batch_id": batch.batch_id,
                                        "resume_tokens": len(submit.resume)})
            try:
                self._start(submit)
            except PromptTooLong as exc:
                self._fail(submit.request_id, ErrorCode.CONTEXT_LENGTH_EXCEEDED, str(exc))
            except PromptInvalid as exc:
                self._fail(submit.request_id, ErrorCode.INVALID_VALUE, str(exc))
            except GrammarError as exc:
                self._fail(submit.request_id, ErrorCode.INVALID_VALUE, str(exc))
            except Exception as exc:
                # Whatever one request's fields do to the tokenizer or the engine, its batch-mates go on.
                log.exception("a request could not start", extra={"request_id": submit.request_id})
                self._fail(submit.request_id, ErrorCode.ENGINE_ERROR, f"the request could not start: {exc}")
        pipe.execute()

    def _return(self, pipe: redis.client.Pipeline, submit: Submit) -> None:
        """A request for a model this worker does not answer to goes back to the queue, never run here."""
        reason = f"this worker answers to {', '.join(self.names)}, not {submit.model}"
        log.warning("returned to the queue", extra={"request_id": submit.request_id, "model": submit.model,
                                                    "worker_id": self.id})
        self._stamp(pipe, submit.request_id, "returned", worker_id=self.id, reason=reason)
        self.streams.event(pipe, Returned(self.id, submit.request_id, reason))

    def _start(self, submit: Submit) -> None:
        reason = delivered_reason(submit.params, submit.resume)
        if reason is not None:
            self._complete(submit, reason)
            return
        prompt_ids = self.loaded.prompt_ids(submit)
        self.engine.add(submit.request_id, prompt_ids, submit.params, submit.resume, submit.background)
        if self.engine.routing is not None:
            self.engine.routing.remember(prefix_keys(submit), prompt_ids)

    def _complete(self, submit: Submit, reason: str) -> None:
        """A migrated request whose tokens were all delivered: only its Done went missing."""
        pipe = self.redis.pipeline(transaction=False)
        done = Done(reason, len(self.loaded.prompt_ids(submit)), len(submit.resume))
        self._send(pipe, submit.request_id, done)
        self._release(pipe, submit.request_id, "finished", reason=reason, tokens=len(submit.resume))
        pipe.execute()

    def _fail(self, request_id: str, code: ErrorCode, message: str) -> None:
        log.warning("request failed", extra={"request_id": request_id, "error": message})
        pipe = self.redis.pipeline(transaction=False)
        self._send(pipe, request_id, Error(code, message))
        self._release(pipe, request_id, "failed", code=code)
        pipe.execute()

    def _cancel(self, cancel: Cancel) -> None:
        # A request the engine no longer runs may still be assigned here in the scheduler's view (an ending whose
        # writes a Redis failover dropped): released all the same, or its slot stays taken.
        if self.engine.cancel(cancel.request_id) or self.redis.hexists(self.keys.assigned(self.id),
                                                                       cancel.request_id):
            log.info("cancelled", extra={"request_id": cancel.request_id})
            pipe = self.redis.pipeline(transaction=False)
            self.progress.forget(pipe, cancel.request_id)
            self._release(pipe, cancel.request_id, "cancelled")
            pipe.execute()

    def _yield(self, message: Yield) -> None:
        """Batch lines hand their slots back: each one still running leaves the engine, neither released nor
        forgotten. The inbox is read after the last step's pipeline ran, so its progress list holds every token it
        made when the scheduler, told by a Yielded, clears its owner and moves it back to the queue from there."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in message.request_ids:
            if not self.engine.cancel(rid):
                continue  # it ended meanwhile: its Finished is on its way
            timing = self.timings.pop(rid, None)
            if timing is not None:
                self.tracing.end(timing.span, **{"llmserve.outcome": "yielded"})
            metrics.FINISHED.labels("yielded").inc()
            self._stamp(pipe, rid, "yielded", worker_id=self.id)
            self.streams.event(pipe, Yielded(self.id, rid))
            log.info("yielded", extra={"request_id": rid, "worker_id": self.id})
        pipe.execute()

    def _publish(self, result: StepResult, step_s: float) -> None:
        """One round trip to Redis per engine step, whatever the batch size."""
        # A worker that stood still past WORKER_TTL (frozen, its VM paused) may have been taken for lost and its
        # requests moved: it checks which are still its own before it publishes.
        if self.heartbeats.stood_still():
            result = self._without_moved(result)
        for failed in [out for out in result.outputs if out.error]:
            self._fail(failed.request_id, failed.error_code, failed.error)
        outputs: list[StepOutput] = [out for out in result.outputs if not out.error]
        if not outputs:
            return
        limit = self.settings.max_message_bytes
        tokens = [(out.request_id, encode(Token(out.index, out.text, out.logprob, out.top_logprobs), limit),
                   out.token_id) for out in outputs]
        pipe = self.redis.pipeline(transaction=False)
        # Every token of the step in one script call (common/resultlog.py): published on its request's channel,
        # then recorded in its progress list (a worker lost in between makes its successor repeat the token,
        # which the gateway drops by its index, rather than skip it) and in its results log. First in the
        # pipeline: what follows (a progress list's expiry, a Done) must come after its token.
        calls = publish_results(pipe, self.keys, self.settings, tokens, writer=self.id)
        for out in outputs:
            rid = out.request_id
            timing = self.timings.get(rid)
            if timing and not timing.first_token_at:
                timing.first_token_at = now()
                self.tracing.event(timing.span, "first_token")
                self._stamp(pipe, rid, "prefill_done", prefill_ms=round(step_s * 1000, 3))
                self._stamp(pipe, rid, "first_token", index=out.index)
            if out.index == 0:
                self.progress.started(pipe, rid)
            if out.finish_reason:
                queue_s = timing.queue_s if timing else 0.0
                self._send(pipe, rid, Done(out.finish_reason, out.prompt_tokens, out.index + 1, queue_s))
                self._release(pipe, rid, "finished", reason=out.finish_reason, tokens=out.index + 1,
                              **(timing.decode_summary(out.index + 1) if timing else {}))
                log.info("finished", extra={"request_id": rid, "finish_reason": out.finish_reason,
                                            "completion_tokens": out.index + 1})
        # Tokens Redis refused: the scheduler moved their requests away while this worker's writes were held up.
        self._drop_moved(refused(calls, pipe.execute()), "its writes reached Redis after the request moved")

    def _without_moved(self, result: StepResult) -> StepResult:
        """The step's results less those of requests no longer this worker's (worker/ownership.py): the moved
        dropped, the forgotten ended with an error."""
        found = standing(self.redis, self.keys, self.id, list(self.timings))
        self._drop_moved(found.moved, "this worker stood still")
        for rid in found.forgotten:
            self.engine.cancel(rid)
            self._fail(rid, ErrorCode.REDIS_UNAVAILABLE, "Redis lost this request's assignment (a node restarted "
                       "without its data) while the worker was cut off from it")
        gone = found.moved | found.forgotten
        return StepResult(result.kind, [out for out in result.outputs if out.request_id not in gone])

    def _drop_moved(self, moved: set[str], why: str) -> None:
        for rid in moved:
            self.engine.cancel(rid)
            if (timing := self.timings.pop(rid, None)) is not None:
                self.tracing.end(timing.span, **{"llmserve.outcome": "moved_away"})
        if moved:
            metrics.MOVED_AWAY.inc(len(moved))
            log.warning("requests moved to other workers: dropped here",
                        extra={"worker_id": self.id, "requests": len(moved), "why": why})

    def _send(self, pipe: redis.client.Pipeline, request_id: str, result: Token | Done | Error) -> None:
        """Publish an end (a Done or an Error), and log it for a stream that may be resumed."""
        publish_results(pipe, self.keys, self.settings,
                        [(request_id, encode(result, self.settings.max_message_bytes), "")], writer=self.id,
                        ending=True)

    def _stamp(self, pipe: redis.client.Pipeline, request_id: str, hop: str, **detail: str | int | float) -> None:
        stamp(pipe, self.keys, request_id, hop, "worker", self.settings.trace_ttl, **detail)

    def _release(self, pipe: redis.client.Pipeline, request_id: str, hop: str, **detail: str | int | float) -> None:
        """The request leaves this worker (`hop` says how): its slot goes back to the scheduler."""
        self.finished_total += 1
        timing = self.timings.pop(request_id, None)
        if timing is not None:
            self.tracing.end(timing.span, error=str(detail.get("code", "")), **{"llmserve.outcome": hop}, **{
                f"llmserve.{name}": value for name, value in detail.items()})
        metrics.FINISHED.labels(hop).inc()
        compat_metrics.released(self.names[0], hop, detail.get("reason"))
        self._stamp(pipe, request_id, hop, worker_id=self.id, **detail)
        self.streams.event(pipe, Finished(self.id, request_id))


def main() -> None:
    settings = WorkerSettings.from_env()
    setup_logging("worker", settings.log_level)
    worker = Worker(settings, *engines.build(settings))
    worker.metrics_port = serve_metrics(settings.worker_metrics_port, "worker")

    def drain(_signum: int, _frame: object) -> None:
        worker.drain()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    worker.run()
