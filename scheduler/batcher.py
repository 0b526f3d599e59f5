"""Which waiting requests go to which worker: pure logic, no Redis."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.protocol import Submit


@dataclass
class WorkerState:
    worker_id: str
    slots: int
    assigned: set[str] = field(default_factory=set)
    draining: bool = False

    @property
    def free(self) -> int:
        """Slots for new work: none while the worker drains before it stops."""
        return 0 if self.draining else self.slots - len(self.assigned)


def plan(waiting: deque[Submit], workers: list[WorkerState]) -> dict[str, list[Submit]]:
    """Pop waiting requests in arrival order, each to the worker with the most free slots.

    Filling the emptiest worker first spreads a burst over all workers (each one
    is separate compute), while each worker still receives its share as one batch.
    """
    free = {w.worker_id: w.free for w in workers if w.free > 0}
    batches: dict[str, list[Submit]] = {}
    while waiting and free:
        worker_id = max(free, key=free.__getitem__)
        batches.setdefault(worker_id, []).append(waiting.popleft())
        free[worker_id] -= 1
        if not free[worker_id]:
            del free[worker_id]
    return batches
