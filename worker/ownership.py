"""Which of a worker's requests are still its own after it stood still past WORKER_TTL (frozen, cut off from
Redis): the scheduler may have taken it for lost and moved them, or Redis may have lost their records (a node that
restarted without its data). The request's owner key (Keys.owner) tells the two apart."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from common.keys import Keys


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
