"""Which of a worker's requests are still its own after it stood still past WORKER_TTL (frozen, cut off from
Redis): the scheduler may have taken it for lost and moved them, or Redis may have lost their records (a node that
restarted without its data). The request's owner key (Keys.owner) tells the two apart. And the reverse (Audit):
assignments to it that it does not hold."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from common.keys import Keys
from common.protocol import Unheld, now
from common.streams import StreamWriter
from worker import metrics

log = logging.getLogger("worker")


@dataclass
class Standing:
    # Moved to other workers: they run them now, so this one publishes nothing more of them, not even an end.
    moved: set[str] = field(default_factory=set)
    # Their assignment is gone but their owner still names this worker: nobody moved them, and nobody else would
    # ever end them, so this worker ends them with an error.
    forgotten: set[str] = field(default_factory=set)


def sort_out(worker_id: str, request_ids: list[str], assignments: list[bytes | None],
             owners: list[bytes | None]) -> Standing:
    """The requests whose assignment to this worker is gone, by what their owner key says."""
    standing = Standing()
    for rid, assignment, owner in zip(request_ids, assignments, owners, strict=True):
        if assignment is None:
            (standing.forgotten if owner == worker_id.encode() else standing.moved).add(rid)
    return standing


def standing(client: redis.Redis, keys: Keys, worker_id: str, request_ids: list[str]) -> Standing:
    """The same, read from Redis in one round trip: the worker's assignments, then each request's owner."""
    if not request_ids:
        return Standing()
    pipe = client.pipeline(transaction=False)
    pipe.hmget(keys.assigned(worker_id), request_ids)
    for rid in request_ids:  # each in its request's slot
        pipe.get(keys.owner(rid))
    assignments, *owners = pipe.execute()
    return sort_out(worker_id, request_ids, assignments, owners)


@dataclass
class Audit:
    """The reverse check, every `every_s`: assignments to this worker that it does not hold. The scheduler writes
    an assignment and its Batch in one pipeline, and a worker's Finished ends one; a Redis failover can keep one
    write of such a pair and drop the other, which would hold a slot (and a client) for ever. An assignment seen
    unheld at two checks `every_s` apart is no Batch still on its way: it is reported, and again each `every_s`
    while it stays (the report too can be dropped)."""

    every_s: float
    next_at: float = 0.0
    suspects: dict[str, float] = field(default_factory=dict)  # request_id -> first seen unheld, or last reported

    def due(self, clock: float) -> bool:
        return clock >= self.next_at

    def report(self, client: redis.Redis, streams: StreamWriter, worker_id: str, held: set[str]) -> None:
        """Read this worker's assignments and tell the scheduler (an Unheld event) those to report."""
        assigned = [rid.decode() for rid in client.hkeys(streams.keys.assigned(worker_id))]
        unheld = self.check(assigned, held, now())
        for rid in unheld:
            log.warning("assigned here but not held: reported", extra={"request_id": rid, "worker_id": worker_id})
        if unheld:
            metrics.UNHELD.inc(len(unheld))
            streams.event(client, Unheld(worker_id, unheld))

    def check(self, assigned: list[str], held: set[str], clock: float) -> list[str]:
        """The assignments to report now, given what the worker holds (orphans dropped on a lost Redis count)."""
        self.next_at = clock + self.every_s
        unheld = [rid for rid in assigned if rid not in held]
        self.suspects = {rid: self.suspects.get(rid, clock) for rid in unheld}
        report = [rid for rid in unheld if clock - self.suspects[rid] >= self.every_s]
        for rid in report:
            self.suspects[rid] = clock
        return report
