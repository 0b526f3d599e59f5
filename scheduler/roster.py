"""The workers the leading scheduler sees: who is alive (their heartbeats), what each runs (its assignments in
Redis), and what happens to a worker that is gone: its requests go back on the stream with the tokens they had
delivered, to continue elsewhere, and its keys are removed; the keys of live workers last no longer than they do.
A batch line a worker handed back (a Yield) goes back on the stream the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from common.errors import ErrorCode
from common.keys import OWNER_TTL_SECONDS, WORKER_KEYS_TTL_SECONDS, Keys
from common.protocol import ProtocolError, Submit, encode, now
from common.runtime import decode_or_drop, parse_heartbeats
from common.settings import SchedulerSettings
from common.streams import StreamWriter
from scheduler import metrics
from scheduler.outcomes import Outcomes
from scheduler.policy import BATCH_OVERHEAD, YIELD_LIMIT, WorkerState, runs_as

log = logging.getLogger("scheduler")


class Roster:
    def __init__(self, redis_client: redis.Redis, keys: Keys, settings: SchedulerSettings, outcomes: Outcomes,
                 read_events: Callable[[], object]) -> None:
        """`read_events`: consume the worker events waiting (before a worker is handled as lost)."""
        self.redis, self.keys, self.settings, self.outcomes = redis_client, keys, settings, outcomes
        self.read_events = read_events
        self.limit = settings.max_message_bytes
        self.streams = StreamWriter(keys, self.limit)
        self.workers: dict[str, WorkerState] = {}
        self.model_of: dict[str, str] = {}  # request_id -> its model, while a worker runs it
        self.next_refresh = 0.0
        self.next_renewal = 0.0  # of the live workers' keys' expiry
        self.swept = False  # for the keys of workers that left while no scheduler led

    def refresh(self) -> None:
        self.next_refresh = now() + self.settings.heartbeat_interval
        ids = sorted(member.decode() for member in self.redis.smembers(self.keys.workers))
        beats = parse_heartbeats(ids, self.redis.mget([self.keys.heartbeat(i) for i in ids]) if ids else [],
                                 self.limit, log)
        gone = [worker_id for worker_id, beat in beats.items() if beat is None] + sorted(self.workers.keys() - set(ids))
        if gone:
            # A worker writes the Finished events of its last step before it leaves: read them now, after its
            # leaving was seen, so that what finished just before is released, not moved and run again.
            self.read_events()
        for worker_id in gone:
            self.lose(worker_id)
        alive: dict[str, WorkerState] = {}
        for worker_id, beat in beats.items():
            if beat is None:
                continue
            state = self.workers.get(worker_id) or self._joined(worker_id, beat.slots)
            state.draining = beat.draining
            state.prefixes = frozenset(beat.prefixes)
            state.models = frozenset(beat.serves())
            alive[worker_id] = state
        self.workers = alive

    def _joined(self, worker_id: str, slots: int) -> WorkerState:
        """A worker seen for the first time (or again, by a new leader): what it already runs comes
        from its assignments in Redis."""
        known, settled = {}, set()
        for rid, payload in self.redis.hgetall(self.keys.assigned(worker_id)).items():
            submit = decode_or_drop(payload, Submit, self.limit, log, "an assignment", worker_id=worker_id)
            known[rid.decode()] = runs_as(submit) if submit else ""
            self.model_of[rid.decode()] = submit.model if submit else ""
            if submit and submit.background and submit.yields >= YIELD_LIMIT:
                settled.add(rid.decode())
        log.info("worker joined", extra={"worker_id": worker_id, "slots": slots, "running": len(known)})
        return WorkerState(worker_id, slots, known, settled=settled)

    def tend_keys(self) -> None:
        """Per-worker keys last no longer than their worker. Once per leadership, the inbox or assignments of a
        worker with no heartbeat (one that left while no scheduler led: a clean stop also takes it off the set
        of workers, so nothing else names it) are handled as a lost worker's; and every so often the live
        workers' keys get their expiry pushed back, so that only the keys of a worker nobody saw leave lapse."""
        if not self.swept:
            found = {self.keys.worker_of(key.decode())
                     for key in self.redis.scan_iter(match=self.keys.worker_keys(), count=1000)}
            unseen = sorted(found - self.workers.keys() - {None})
            # One that started beating since the refresh is alive (a gateway may have asked it something).
            beats = self.redis.mget([self.keys.heartbeat(i) for i in unseen]) if unseen else []
            for worker_id, beat in zip(unseen, beats, strict=True):
                if beat is None:
                    self.lose(worker_id)
            self.swept = True
        if now() < self.next_renewal:
            return
        self.next_renewal = now() + WORKER_KEYS_TTL_SECONDS / 4
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in self.workers:
            pipe.expire(self.keys.inbox(worker_id), WORKER_KEYS_TTL_SECONDS)
            pipe.expire(self.keys.assigned(worker_id), WORKER_KEYS_TTL_SECONDS)
        pipe.execute()

    def lose(self, worker_id: str) -> None:
        """Put the requests of a worker that is gone back on the stream, each with the tokens it has
        already delivered, then remove the worker's keys. Each request is handled on its own: one that cannot
        move fails alone."""
        assigned = self.redis.hgetall(self.keys.assigned(worker_id))
        if assigned:
            metrics.WORKERS_LOST.inc()
        level = logging.WARNING if assigned else logging.INFO
        log.log(level, "worker gone", extra={"worker_id": worker_id, "in_flight": len(assigned)})
        pipe = self.redis.pipeline(transaction=False)
        self._move_on(pipe, worker_id, {rid.decode(): payload for rid, payload in assigned.items()})
        # One key a command: a cluster pipeline takes no multi-key DEL.
        pipe.delete(self.keys.assigned(worker_id))
        pipe.delete(self.keys.inbox(worker_id))
        pipe.srem(self.keys.workers, worker_id)
        pipe.execute()

    def reclaim(self, pipe: redis.client.Pipeline, worker_id: str, request_ids: list[str]) -> None:
        """Assignments a live worker says it does not hold (an Unheld event). One this scheduler freed already (its
        HDEL lost, or still in `pipe` behind an event read just before) is only removed. Of the others, one whose
        owner key no longer names the worker ended (only its Finished was lost) and is released; the rest (their
        Batch lost) move on as a lost worker's. A worker not seen alive is left to `lose`."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        known = [rid for rid in request_ids if rid in worker.assigned]
        for rid in request_ids:
            pipe.hdel(self.keys.assigned(worker_id), rid)
        if not known:
            return
        reads = self.redis.pipeline(transaction=False)
        reads.hmget(self.keys.assigned(worker_id), known)
        for rid in known:
            reads.get(self.keys.owner(rid))
        payloads, *owners = reads.execute()
        stray: dict[str, bytes] = {}
        for rid, payload, owner in zip(known, payloads, owners, strict=True):
            worker.assigned.pop(rid, None)
            worker.settled.discard(rid)
            if payload is not None and owner in (None, worker_id.encode()):
                stray[rid] = payload
            else:  # PUBLISH_RESULTS marks an ended request's owner ''
                self.model_of.pop(rid, None)
                log.warning("unheld assignment released: the request ended", extra={"request_id": rid,
                                                                                    "worker_id": worker_id})
        metrics.UNHELD.inc(len(known))
        self._move_on(pipe, worker_id, stray)

    def _move_on(self, pipe: redis.client.Pipeline, worker_id: str, assigned: dict[str, bytes]) -> None:
        """Requests that left their worker unfinished, each back on the stream with the tokens it had delivered;
        one that cannot move fails alone."""
        for rid in assigned:
            self.model_of.pop(rid, None)
        for (rid, payload), delivered in zip(assigned.items(), self._fence(list(assigned)), strict=True):
            submit = decode_or_drop(payload, Submit, self.limit, log, "an assignment", worker_id=worker_id)
            try:
                if submit is not None:
                    self.migrate(pipe, submit, delivered)
            except Exception:
                log.exception("a request could not be migrated; set aside", extra={"request_id": rid})
                self.outcomes.dead_letter(pipe, submit, "it raised while migrating")

    def _fence(self, request_ids: list[str]) -> list[list[int]]:
        """The tokens each request delivered, read after its owner is cleared, in one round trip: a write of its old
        worker that reaches Redis later (it was partitioned, not dead) is refused, and cannot add to the tokens the
        next worker resumes from."""
        reads = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            reads.set(self.keys.owner(rid), "", ex=OWNER_TTL_SECONDS)
            self.outcomes.progress.read(reads, rid)
        return [[int(t) for t in delivered] for delivered in reads.execute()[1::2]]

    def migrate(self, pipe: redis.client.Pipeline, submit: Submit, delivered: list[int]) -> None:
        rid = submit.request_id
        if submit.migrations >= self.settings.migration_limit:
            metrics.MIGRATION_FAILURES.inc()
            self.outcomes.fail(pipe, rid, ErrorCode.MIGRATION_LIMIT,
                       f"the request lost its worker {submit.migrations + 1} times")
            return
        submit.migrations += 1
        if self._put_back(pipe, submit, delivered, "lost its worker") is None:
            return
        metrics.MIGRATIONS.inc()
        self.outcomes.stamp(pipe, rid, "migrated", resume_tokens=len(delivered), migrations=submit.migrations)
        log.warning("migrating", extra={"request_id": rid, "resume_tokens": len(delivered),
                                        "migrations": submit.migrations})

    def take_back(self, pipe: redis.client.Pipeline, worker_id: str, request_id: str, cancelled: bool) -> None:
        """A batch line its worker handed back (a Yield: its Yielded event) goes back on the stream with the tokens
        it delivered, one more yield counted and counted in again (it left the admission counts at dispatch); one
        `cancelled` meanwhile (its client's cancel reached the worker too late) ends here. An assignment gone
        already moved with its lost worker: its owner, the next worker's by now, is left alone."""
        payload = self.redis.hget(self.keys.assigned(worker_id), request_id)
        if payload is None:
            return
        if (worker := self.workers.get(worker_id)) is not None:
            worker.assigned.pop(request_id, None)
        self.model_of.pop(request_id, None)
        [delivered] = self._fence([request_id])  # as for a lost worker: nothing it writes lands after
        pipe.hdel(self.keys.assigned(worker_id), request_id)
        submit = decode_or_drop(payload, Submit, self.limit, log, "a yielded assignment", worker_id=worker_id)
        if submit is None:
            self.outcomes.fail(pipe, request_id, ErrorCode.INTERNAL_ERROR, "its assignment could not be read back")
            return
        if cancelled:
            self.outcomes.progress.forget(pipe, request_id)
            self.outcomes.stamp(pipe, request_id, "cancelled", where="yielded")
            return
        submit.yields += 1
        requeued = self._put_back(pipe, submit, delivered, "handed its slot back")
        if requeued is None:
            return
        if not submit.migrations:
            self.outcomes.counts.count_in(pipe, 1, len(requeued))
        metrics.LINES_YIELDED.inc()
        self.outcomes.stamp(pipe, request_id, "requeued", reason="yielded", resume_tokens=len(delivered),
                            yields=submit.yields)
        log.info("yielded line requeued", extra={"request_id": request_id, "worker_id": worker_id,
                                                 "resume_tokens": len(delivered), "yields": submit.yields})

    def _put_back(self, pipe: redis.client.Pipeline, submit: Submit, delivered: list[int], why: str) -> bytes | None:
        """Queue `submit` again, to continue from `delivered`: its payload, or None (failed: it no longer fits)."""
        submit.resume = delivered
        try:
            payload = encode(submit, self.limit - BATCH_OVERHEAD)
        except ProtocolError:
            self.outcomes.fail(pipe, submit.request_id, ErrorCode.REQUEST_TOO_LARGE,
                       f"the request {why}, and with its {len(delivered)} delivered tokens it no longer fits one "
                       "message to another")
            return None
        self.streams.request(pipe, payload)
        return payload
