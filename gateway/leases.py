"""Who still wants a stream: a lease per stream in Redis, shared by every gateway.

A stream's lease (its first request_id in the sorted set `Keys.leases`, scored by when it lapses,
in Redis's clock) is taken at admission and extended every RESUME_GRACE / 4 by each gateway that
has a client reading the stream. A client that goes away leaves the lease to lapse RESUME_GRACE
later; one that comes back, on any gateway, extends it again. A gateway that dies stops extending
the leases of all its streams at once, which then lapse like any disconnect. Every gateway sweeps
lapsed leases (claiming each atomically, so that one gateway handles it) and cancels their requests.
Nothing depends on the gateway that held a stream being alive."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from common import scripts
from common.clients import is_cluster
from common.keys import Keys
from common.runtime import REDIS_ERRORS, stop_task
from common.settings import GatewaySettings

log = logging.getLogger("gateway")

CLAIM_BATCH = 256
LONGEST_INTERVAL = 1.0


class Leases:
    def __init__(self, redis: Any, keys: Keys, settings: GatewaySettings,
                 on_lapsed: Callable[[list[str]], Awaitable[None]]) -> None:
        self.redis = redis
        self.keys = keys
        self.cluster = is_cluster(settings.redis_url)
        self.grace_ms = int(settings.resume_grace * 1000)
        self.log_ttl_ms = int(settings.resume_ttl * 1000)
        # With RESUME_GRACE=0 a disconnect cancels at once and nothing is leased.
        self.enabled = self.grace_ms > 0 and self.log_ttl_ms > 0
        self.interval = min(settings.resume_grace / 4, LONGEST_INTERVAL)
        self.on_lapsed = on_lapsed
        # Streams read here: their request_ids, and how many of this gateway's clients read each.
        self.held: dict[str, list[str]] = {}
        self.readers: Counter[str] = Counter()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.enabled:
            self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self.task)

    def hold(self, request_ids: list[str]) -> None:
        """A client of this gateway reads the stream: extend its lease until it lets go."""
        head = request_ids[0]
        self.held[head] = request_ids
        self.readers[head] += 1

    def let_go(self, head: str) -> None:
        self.readers[head] -= 1
        if self.readers[head] <= 0:
            del self.readers[head]
            self.held.pop(head, None)

    async def extend(self, heads: list[str], request_ids: Sequence[str] = ()) -> None:
        """Leases of `heads` to RESUME_GRACE from now (those that still exist), logs of `request_ids`
        to RESUME_TTL."""
        if not heads:
            return
        logs = [self.keys.log(rid) for rid in request_ids] if self.log_ttl_ms else []
        keys = [self.keys.leases, *([] if self.cluster else logs)]
        if not self.cluster or not logs:
            await self.redis.eval(scripts.EXTEND_LEASES, len(keys), *keys, self.grace_ms, self.log_ttl_ms, *heads)
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.eval(scripts.EXTEND_LEASES, len(keys), *keys, self.grace_ms, self.log_ttl_ms, *heads)
        for log_key in logs:
            pipe.pexpire(log_key, self.log_ttl_ms)
        await pipe.execute()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                held = dict(self.held)
                await self.extend(list(held), [rid for ids in held.values() for rid in ids])
                lapsed = await self.redis.eval(scripts.CLAIM_LEASES, 1, self.keys.leases, CLAIM_BATCH)
                if lapsed:
                    await self.on_lapsed([head.decode() for head in lapsed])
            except (*REDIS_ERRORS, OSError) as exc:
                log.debug("leases not extended or swept", extra={"error": str(exc)})
            except Exception:
                log.exception("lease sweep failed")
