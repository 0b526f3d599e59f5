"""What the watching routes and admission's checks read of the cluster: live workers (their heartbeats), each
model's load, the queue's depth, a key's priority floor, a request's trace; the often-asked ones cached for a
second."""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis

from common.keys import Keys
from common.protocol import Heartbeat, ModelLoad, ProtocolError, TraceEvent, decode
from common.runtime import parse_heartbeats

log = logging.getLogger("gateway")

CACHE_SECONDS = 1.0
FLOORS_CACHED = 10_000  # keys whose priority floor is remembered at once


class ClusterView:
    def __init__(self, redis: Redis, keys: Keys, limit: int) -> None:
        self.redis, self.keys, self.limit = redis, keys, limit
        self._workers: tuple[float, list[Heartbeat]] = (0.0, [])
        self._floors: dict[str, tuple[float, int | None]] = {}

    async def trace(self, request_id: str) -> list[TraceEvent]:
        raw = await self.redis.lrange(self.keys.trace(request_id), 0, -1)
        events = [decode(item, TraceEvent, self.limit) for item in raw]
        return sorted(events, key=lambda event: event.at)

    async def model_load(self, model: str) -> ModelLoad:
        """The model's requests waiting and running, as the leading scheduler last counted them (none known:
        zeros)."""
        raw = await self.redis.hget(self.keys.models, model)
        if raw is None:
            return ModelLoad()
        try:
            return decode(raw, ModelLoad, self.limit)
        except ProtocolError:
            return ModelLoad()

    async def queue_depth(self) -> int:
        return max(int(await self.redis.get(self.keys.queued) or 0), 0)

    async def priority_floor(self, tenant: str) -> int | None:
        """The lowest priority a key's requests may run at, if it has one (cached for a second per key)."""
        fetched_at, floor = self._floors.get(tenant, (0.0, None))
        if time.monotonic() - fetched_at >= CACHE_SECONDS:
            raw = await self.redis.hget(self.keys.priority_floors, tenant)
            floor = int(raw) if raw is not None and raw.lstrip(b"-").isdigit() else None
            if len(self._floors) >= FLOORS_CACHED:
                self._floors.clear()
            self._floors[tenant] = (time.monotonic(), floor)
        return floor

    async def live_workers(self) -> list[Heartbeat]:
        """Heartbeats of the live workers, cached for a second (it is asked on every request)."""
        fetched_at, workers = self._workers
        if time.monotonic() - fetched_at < CACHE_SECONDS:
            return workers
        ids = [i.decode() for i in await self.redis.smembers(self.keys.workers)]
        raws = await self.redis.mget([self.keys.heartbeat(i) for i in ids]) if ids else []
        workers = [beat for beat in parse_heartbeats(ids, raws, self.limit, log).values() if beat is not None]
        self._workers = (time.monotonic(), workers)
        return workers
