"""A worker's heartbeats, on a thread of their own: one long step (a long prompt's prefill on a busy CPU) must not
make a working worker look lost and have its requests moved. Each beat is the heartbeat key (expiring after
WORKER_TTL) and the worker's place in the set of workers; a beat that fails, for any reason, is logged and counted
and the next one goes all the same. It also tells when the worker stood still past WORKER_TTL (`stood_still`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from common.keys import Keys
from common.protocol import Heartbeat, encode, now
from common.runtime import REDIS_ERRORS
from common.settings import WorkerSettings
from worker import metrics

log = logging.getLogger("worker")


class Heartbeats:
    def __init__(self, client: redis.Redis, keys: Keys, settings: WorkerSettings, worker_id: str,
                 compose: Callable[[], Heartbeat]) -> None:
        self.redis, self.keys, self.settings, self.id, self.compose = client, keys, settings, worker_id, compose
        self.beating = True
        self.now_please = threading.Event()  # set to send a heartbeat at once (draining, Redis back)
        self.last = now()  # when the last one went out
        self.gap_seen = False  # a beat found the one before it over WORKER_TTL ago
        self.thread = threading.Thread(target=self.run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.beating = False
        self.now_please.set()
        self.thread.join()

    def soon(self) -> None:
        self.now_please.set()

    def stood_still(self) -> bool:
        """Whether the worker may have been taken for lost since it last looked: a beat found a gap over
        WORKER_TTL, or none has gone out for that long. Asking clears the first."""
        seen, self.gap_seen = self.gap_seen, False
        return seen or now() - self.last > self.settings.worker_ttl

    def run(self) -> None:
        while self.beating:
            try:
                self.send()
            except REDIS_ERRORS as exc:
                metrics.HEARTBEAT_ERRORS.labels("redis").inc()
                log.debug("heartbeat not sent", extra={"worker_id": self.id, "error": str(exc)})
            except Exception:
                # A fault of its own (an engine's report that fails) must not end the heartbeats of a worker
                # that still serves: the scheduler would take it for lost and move every stream it holds.
                metrics.HEARTBEAT_ERRORS.labels("internal").inc()
                log.exception("heartbeat not sent", extra={"worker_id": self.id})
            self.now_please.wait(self.settings.heartbeat_interval)
            self.now_please.clear()

    def send(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.id), encode(self.compose(), self.settings.max_message_bytes),
                 px=int(self.settings.worker_ttl * 1000))
        pipe.sadd(self.keys.workers, self.id)
        pipe.execute()
        sent = now()
        self.gap_seen = self.gap_seen or sent - self.last > self.settings.worker_ttl
        self.last = sent
