"""The gateway's side of the bus: admit requests to the queue, receive their
results, cancel what a client abandons."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import redis.asyncio as aioredis

from common.protocol import PAYLOAD, Cancel, Heartbeat, Keys, ProtocolError, Result, Submit, Token, decode, encode
from common.settings import Settings
from gateway.results import ResultRouter

REQUEST_STREAM_MAXLEN = 100_000
WORKERS_CACHE_SECONDS = 1.0

# Admission and publication in one atomic step: the queue bound is exact under any
# burst, and all choices of one HTTP request are admitted together or not at all.
# KEYS: queued counter, request stream. ARGV: bound, stream maxlen, payloads...
_ADMIT = """
local queued = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = #ARGV - 2
if queued > 0 and queued + n > tonumber(ARGV[1]) then return 0 end
redis.call('INCRBY', KEYS[1], n)
for i = 3, #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[i])
end
return 1
"""


class QueueFull(Exception):
    pass


class Bus:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limit = settings.max_message_bytes
        self.keys = Keys(settings.namespace)
        self.redis = aioredis.from_url(settings.redis_url)
        self.router = ResultRouter(settings.redis_url, self.keys, self.limit)
        self.admit_script = self.redis.register_script(_ADMIT)
        self._workers: tuple[float, list[Heartbeat]] = (0.0, [])

    async def start(self) -> None:
        await self.router.start()

    async def stop(self) -> None:
        await self.router.stop()
        await self.redis.aclose()

    @asynccontextmanager
    async def session(self, submits: list[Submit]) -> AsyncIterator[AsyncIterator[tuple[int, Result]]]:
        """Admit the requests (or raise QueueFull) and yield their results as (choice, result)
        up to each one's Done or Error. Leaving early (the client went away, another choice
        failed) cancels every request still running, wherever it is."""
        pending = set(range(len(submits)))
        async with self.router.open([s.request_id for s in submits]) as mailbox:
            admitted = await self.admit_script(keys=[self.keys.queued, self.keys.requests],
                                               args=[self.settings.max_queue, REQUEST_STREAM_MAXLEN,
                                                     *(encode(s, self.limit) for s in submits)])
            if not admitted:
                raise QueueFull

            async def results() -> AsyncIterator[tuple[int, Result]]:
                next_index = [0] * len(submits)
                while pending:
                    choice, result = await mailbox.get()
                    if choice not in pending:
                        continue
                    if isinstance(result, Token):
                        # After a migration the new worker may repeat the last token the old one sent.
                        if result.index < next_index[choice]:
                            continue
                        next_index[choice] = result.index + 1
                    else:
                        pending.discard(choice)
                    yield choice, result

            try:
                yield results()
            finally:
                if pending:
                    with anyio.CancelScope(shield=True):
                        await self._cancel([submits[i].request_id for i in pending])

    async def _cancel(self, request_ids: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.xadd(self.keys.requests, {PAYLOAD: encode(Cancel(rid), self.limit)},
                      maxlen=REQUEST_STREAM_MAXLEN, approximate=True)
        await pipe.execute()

    async def live_workers(self) -> list[Heartbeat]:
        """Heartbeats of the live workers, cached for a second (it is asked on every request)."""
        fetched_at, workers = self._workers
        if time.monotonic() - fetched_at < WORKERS_CACHE_SECONDS:
            return workers
        ids = await self.redis.smembers(self.keys.workers)
        beats = await self.redis.mget([self.keys.heartbeat(i.decode()) for i in ids]) if ids else []
        workers = []
        for raw in beats:
            if raw is not None:
                try:
                    workers.append(decode(raw, Heartbeat, self.limit))
                except ProtocolError:
                    continue
        self._workers = (time.monotonic(), workers)
        return workers
