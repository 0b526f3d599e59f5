"""Leadership among scheduler replicas: one holds the lease (LEADER_LEASE) and the rest stand by. A new leader
first settles what its predecessor left on the request stream: entries pending through POISON_LIMIT leaders that
died are taken as what killed them and set aside; the rest are claimed again, each delivery counted."""

from __future__ import annotations

import logging

import redis

from common import scripts
from common.keys import PAYLOAD, SCHEDULER_GROUP, Keys
from common.protocol import RequestMessage, Submit
from common.runtime import decode_or_drop
from common.settings import SchedulerSettings
from scheduler.outcomes import Outcomes
from scheduler.policy import Queued

log = logging.getLogger("scheduler")

# One consumer name for every replica: a new leader reads its predecessor's pending entries.
CONSUMER = "scheduler"


class Leadership:
    def __init__(self, redis_client: redis.Redis, keys: Keys, settings: SchedulerSettings, outcomes: Outcomes,
                 scheduler_id: str) -> None:
        self.redis, self.keys, self.settings, self.outcomes = redis_client, keys, settings, outcomes
        self.id = scheduler_id
        self.first_take_over = True

    def hold(self) -> bool:
        """Take or keep the lease; False while another scheduler holds it."""
        ttl_ms = int(self.settings.worker_ttl * 1000)
        return bool(self.redis.eval(scripts.LEADER_LEASE, 1, self.keys.lease, self.id, ttl_ms))

    def settle_pending(self) -> dict[int, list[bytes]]:
        """The consumer groups made sure of and the poisoned entries set aside: the other pending request entries
        by the delivery count each is to be claimed with (`claim`, once the caller has read them again)."""
        for stream in (self.keys.requests, self.keys.events):
            try:
                self.redis.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        pending = {p["message_id"]: p["times_delivered"]
                   for p in self.redis.xpending_range(self.keys.requests, SCHEDULER_GROUP, "-", "+", 1 << 20)}
        # A leader that died without a signal may have died of an entry it held: each such take-over counts
        # one delivery against every pending entry (a re-read counts one more, which `claim` takes back).
        blame = int(self.first_take_over and not self.redis.getdel(self.keys.clean_exit))
        self.first_take_over = False
        poisoned = [entry for entry, count in pending.items() if blame and count >= self.settings.poison_limit]
        self._set_aside(poisoned)
        counts: dict[int, list[bytes]] = {}
        for entry, count in pending.items():
            if entry not in poisoned:
                counts.setdefault(count + blame, []).append(entry)
        return counts

    def claim(self, counts: dict[int, list[bytes]]) -> None:
        for count, entries in counts.items():
            self.redis.xclaim(self.keys.requests, SCHEDULER_GROUP, CONSUMER, 0, entries, retrycount=count,
                              justid=True)

    def leave_clean(self) -> None:
        """A successor need not count the entries this leader held as having crashed it."""
        self.redis.set(self.keys.clean_exit, self.id, px=int(self.settings.worker_ttl * 10_000))

    def _set_aside(self, poisoned: list[bytes]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in poisoned:
            found = self.redis.xrange(self.keys.requests, entry_id, entry_id)
            payload = found[0][1].get(PAYLOAD) if found else None
            message = decode_or_drop(payload, RequestMessage, self.settings.max_message_bytes, log,
                                     "a poisoned entry", entry=entry_id)
            if isinstance(message, Submit):
                self.outcomes.dead_letter(pipe, message, "it was pending when the scheduler died, repeatedly")
                self.outcomes.leave_queue(pipe, [Queued(message, entry_id, len(payload))])
            else:
                self.outcomes.ack(pipe, self.keys.requests, [entry_id])
        pipe.execute()
