"""The worker process: reads batches from its inbox, steps the engine, publishes
each request's tagged results and tells the scheduler when a slot frees up."""

from __future__ import annotations

import logging
import os
import signal
import socket
import uuid

import redis

from common.logs import setup_logging
from common.protocol import (
    PAYLOAD,
    Batch,
    Cancel,
    Done,
    Error,
    Finished,
    Heartbeat,
    InboxMessage,
    Keys,
    ProtocolError,
    Token,
    decode,
    encode,
    now,
)
from common.settings import Settings
from worker.engine import Engine, PromptTooLong, StepOutput
from worker.model import LoadedModel, load_model

log = logging.getLogger("worker")


class Worker:
    def __init__(self, settings: Settings, loaded: LoadedModel) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.loaded = loaded
        self.engine = Engine(loaded, settings.worker_slots)
        self.inbox_cursor = "0-0"
        self.finished_total = 0
        self.next_heartbeat = 0.0
        self.stopping = False

    def run(self) -> None:
        log.info("worker ready", extra={"worker_id": self.id, "model": self.loaded.name,
                                        "slots": self.settings.worker_slots})
        try:
            while not self.stopping:
                self._heartbeat_if_due()
                self._read_inbox(block=not self.engine.has_work())
                self._step()
        finally:
            self.redis.srem(self.keys.workers, self.id)
            self.redis.delete(self.keys.heartbeat(self.id), self.keys.inbox(self.id))

    def _heartbeat_if_due(self) -> None:
        if now() < self.next_heartbeat:
            return
        beat = Heartbeat(self.id, self.loaded.name, self.loaded.max_length, self.settings.worker_slots,
                         len(self.engine.running),
                         len(self.engine.waiting), self.finished_total, now())
        ttl_ms = int(self.settings.worker_ttl * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.id), encode(beat, self.settings.max_message_bytes), px=ttl_ms)
        pipe.sadd(self.keys.workers, self.id)
        pipe.execute()
        self.next_heartbeat = now() + self.settings.heartbeat_interval

    def _read_inbox(self, block: bool) -> None:
        wait_ms = int(self.settings.heartbeat_interval * 1000) if block else None
        replies = self.redis.xread({self.keys.inbox(self.id): self.inbox_cursor}, block=wait_ms)
        for _stream, entries in replies:
            for entry_id, fields in entries:
                self.inbox_cursor = entry_id
                try:
                    message = decode(fields[PAYLOAD], InboxMessage, self.settings.max_message_bytes)
                except (ProtocolError, KeyError) as exc:
                    log.error("dropped a malformed inbox message", extra={"entry": entry_id, "error": str(exc)})
                    continue
                if isinstance(message, Batch):
                    self._admit(message)
                else:
                    self._cancel(message)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # A failed forward (out of memory, a bad model) must not take the worker down nor leave
            # streams hanging: every sequence in the engine gets an error and the engine starts afresh.
            log.exception("engine step failed", extra={"worker_id": self.id})
            for sequence in self.engine.abort_all():
                self._fail(sequence.request_id, "engine_error", "the worker failed while generating")
            return
        self._publish(outputs)

    def _admit(self, batch: Batch) -> None:
        for submit in batch.sequences:
            log.info("admitted", extra={"request_id": submit.request_id, "batch_id": batch.batch_id})
            try:
                self.engine.add(submit.request_id, self.loaded.prompt_ids(submit), submit.params)
            except PromptTooLong as exc:
                self._fail(submit.request_id, "context_length_exceeded", str(exc))

    def _fail(self, request_id: str, code: str, message: str) -> None:
        log.warning("request failed", extra={"request_id": request_id, "error": message})
        pipe = self.redis.pipeline(transaction=False)
        self._send(pipe, request_id, Error(code, message))
        self._release(pipe, request_id)
        pipe.execute()

    def _cancel(self, cancel: Cancel) -> None:
        if self.engine.cancel(cancel.request_id):
            log.info("cancelled", extra={"request_id": cancel.request_id})
            pipe = self.redis.pipeline(transaction=False)
            self._release(pipe, cancel.request_id)
            pipe.execute()

    def _publish(self, outputs: list[StepOutput]) -> None:
        """One round trip to Redis per engine step, whatever the batch size."""
        if not outputs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for out in outputs:
            rid = out.sequence.request_id
            self._send(pipe, rid, Token(out.index, out.text, out.logprob, out.top_logprobs))
            if out.finish_reason:
                self._send(pipe, rid, Done(out.finish_reason, len(out.sequence.prompt_ids), out.index + 1))
                self._release(pipe, rid)
                log.info("finished", extra={"request_id": rid, "finish_reason": out.finish_reason,
                                            "completion_tokens": out.index + 1})
        pipe.execute()

    def _send(self, pipe: redis.client.Pipeline, request_id: str, result: Token | Done | Error) -> None:
        pipe.publish(self.keys.results(request_id), encode(result, self.settings.max_message_bytes))

    def _release(self, pipe: redis.client.Pipeline, request_id: str) -> None:
        self.finished_total += 1
        event = Finished(self.id, request_id)
        pipe.xadd(self.keys.events, {PAYLOAD: encode(event, self.settings.max_message_bytes)},
                  maxlen=100_000, approximate=True)


def main() -> None:
    settings = Settings.from_env()
    setup_logging("worker", settings.log_level)
    worker = Worker(settings, load_model(settings))

    def stop(_signum: int, _frame: object) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
