"""What the scheduler writes of a request's fate, each into a pipeline: its trace stamps, its stream entries done,
its admission counts lowered as it leaves the queue, and an error to its client (with a dead letter for an
operator, when the request is set aside)."""

from __future__ import annotations

import logging

import redis

from common.counters import QueueCounts
from common.errors import ErrorCode
from common.journey import stamp
from common.keys import SCHEDULER_GROUP, Keys
from common.progress import Progress
from common.protocol import Error, Submit, encode
from common.resultlog import publish_results
from common.settings import SchedulerSettings
from common.streams import StreamWriter
from scheduler import metrics
from scheduler.policy import Queued

log = logging.getLogger("scheduler")


class Outcomes:
    def __init__(self, keys: Keys, settings: SchedulerSettings) -> None:
        self.keys, self.settings, self.limit = keys, settings, settings.max_message_bytes
        self.counts = QueueCounts(keys)
        self.streams = StreamWriter(keys, self.limit)
        self.progress = Progress(keys)

    def fail(self, pipe: redis.client.Pipeline, request_id: str, code: ErrorCode, message: str) -> None:
        """End a request the scheduler holds with an error to its client."""
        log.warning("request failed", extra={"request_id": request_id, "code": code, "error": message})
        # Published and logged like a worker's results, so that a client resuming the stream sees it too.
        publish_results(pipe, self.keys, self.settings, [(request_id, encode(Error(code, message), self.limit), "")])
        self.progress.forget(pipe, request_id)
        self.stamp(pipe, request_id, "failed", code=code)
        metrics.FAILED.labels(code).inc()

    def dead_letter(self, pipe: redis.client.Pipeline, submit: Submit | None, reason: str) -> None:
        """Set a request aside for an operator (its id and why, never its prompt) and fail it."""
        if submit is None:
            return
        metrics.DEAD_LETTERS.inc()
        self.streams.dead_letter(pipe, submit.request_id, reason, "scheduler")
        self.fail(pipe, submit.request_id, ErrorCode.DEAD_LETTER, f"the request was set aside: {reason}")

    def leave_queue(self, pipe: redis.client.Pipeline, items: list[Queued]) -> None:
        """Requests off the waiting queue: their stream entries are done, and the admission counts drop
        for those the gateway counted in (not those re-queued after a worker loss)."""
        self.ack(pipe, self.keys.requests, [item.entry_id for item in items])
        admitted = [item for item in items if not item.submit.migrations]
        if admitted:
            self.counts.count_out(pipe, len(admitted), sum(item.size for item in admitted))

    def ack(self, pipe: redis.client.Pipeline, stream: str, entry_ids: list[bytes]) -> None:
        """Acknowledge and delete: a consumed entry keeps nothing in Redis."""
        if entry_ids:
            pipe.xack(stream, SCHEDULER_GROUP, *entry_ids)
            pipe.xdel(stream, *entry_ids)

    def stamp(self, pipe: redis.client.Pipeline, request_id: str, hop: str, **detail: str | int | float) -> None:
        stamp(pipe, self.keys, request_id, hop, "scheduler", self.settings.trace_ttl, **detail)
