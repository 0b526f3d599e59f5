"""Output tokens per second across all gateways, for the cluster view (/v1/cluster, the page, `llmserve
status`): each gateway adds what it delivered to a per-second counter in Redis, once a second, and any
gateway reads the last minutes of them back, so the view is the same behind any replica."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from common.keys import Keys
from common.runtime import REDIS_ERRORS, stop_task

log = logging.getLogger("gateway")

HORIZON_S = 300  # the history the view shows; counters expire soon after it


class Throughput:
    """Tokens per second of Unix time, over the horizon: the rate of any window and a sampled history."""

    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts

    def rate(self, window_s: int = 10, until: int | None = None) -> float:
        end = int(time.time()) if until is None else until
        return sum(self.counts.get(second, 0) for second in range(end - window_s + 1, end + 1)) / window_s

    def history(self, step_s: int = 5, horizon_s: int = HORIZON_S) -> list[list[float]]:
        end = int(time.time())
        return [[t, self.rate(step_s, t)] for t in range(end - horizon_s + step_s, end + 1, step_s)]


class SharedThroughput:
    def __init__(self, redis: Any, keys: Keys, interval_s: float = 1.0) -> None:
        self.redis, self.keys, self.interval_s = redis, keys, interval_s
        self.pending = 0
        self.task: asyncio.Task[None] | None = None

    def add(self, tokens: int) -> None:
        self.pending += tokens

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self.task)
        await self.flush()

    async def flush(self) -> None:
        """Add the tokens delivered since the last flush to this second's counter (kept while Redis is away)."""
        tokens, self.pending = self.pending, 0
        if not tokens:
            return
        key = self.keys.tokens(int(time.time()))
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.incrby(key, tokens)
            pipe.expire(key, HORIZON_S + 60)
            await pipe.execute()
        except (*REDIS_ERRORS, OSError) as exc:
            self.pending += tokens
            log.debug("throughput not recorded", extra={"error": str(exc)})

    async def read(self) -> Throughput:
        """Every gateway's counters of the horizon (one MGET: the keys share the namespace's slot)."""
        now = int(time.time())
        seconds = list(range(now - HORIZON_S, now + 1))
        values = await self.redis.mget([self.keys.tokens(second) for second in seconds])
        return Throughput({second: int(v) for second, v in zip(seconds, values, strict=True) if v})

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()
