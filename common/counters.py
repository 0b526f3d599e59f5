"""The admission counts every gateway's QUEUE_MAX and QUEUE_MAX_BYTES read: the requests admitted and not yet
taken off the scheduler's waiting queue, and their bytes. ADMIT (common/scripts.py) raises them in the step
that checks them; the scheduler raises them again for a request a worker gave back and lowers them as requests
leave its queue, with the two operations here."""

from __future__ import annotations

from typing import Any

from common.keys import Keys


class QueueCounts:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def count_in(self, pipe: Any, requests: int, size: int) -> None:
        pipe.incrby(self.keys.queued, requests)
        pipe.incrby(self.keys.queued_bytes, size)

    def count_out(self, pipe: Any, requests: int, size: int) -> None:
        pipe.decrby(self.keys.queued, requests)
        pipe.decrby(self.keys.queued_bytes, size)
