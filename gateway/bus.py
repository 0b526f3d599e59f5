"""The gateway's side of the bus: admit requests to the queue, receive their
results, cancel what a client abandons."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from common.protocol import (
    PAYLOAD,
    Cancel,
    Done,
    Heartbeat,
    Keys,
    ProtocolError,
    Result,
    Submit,
    Token,
    TraceEvent,
    decode,
    encode,
)
from common.settings import Settings
from common.trace import stamp
from gateway import metrics
from gateway.results import Mailbox, ResultRouter

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


POOL_CONNECTIONS = 64
POOL_WAIT_SECONDS = 30.0


class Bus:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limit = settings.max_message_bytes
        self.keys = Keys(settings.namespace)
        # A burst of a thousand arrivals waits its turn for a connection instead of failing with
        # "Too many connections"; each command holds one for well under a millisecond.
        self.redis = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_SECONDS))
        self.router = ResultRouter(settings.redis_url, self.keys, self.limit)
        self._workers: tuple[float, list[Heartbeat]] = (0.0, [])
        self.throughput = metrics.Throughput()

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
            await self._admit(submits)
            metrics.ACTIVE.inc()
            try:
                yield self._results(mailbox, len(submits), pending)
            finally:
                metrics.ACTIVE.dec()
                with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                    await self._close(submits, pending)

    async def _admit(self, submits: list[Submit]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for submit in submits:
            self._stamp(pipe, submit.request_id, "received")
        payloads = [encode(s, self.limit) for s in submits]
        # Plain EVAL: Redis caches the compiled script, and unlike a registered Script in a
        # pipeline it costs no SCRIPT EXISTS round trip per request.
        pipe.eval(_ADMIT, 2, self.keys.queued, self.keys.requests, self.settings.max_queue,
                  REQUEST_STREAM_MAXLEN, *payloads)
        *_, admitted = await pipe.execute()
        if not admitted:
            raise QueueFull

    async def _results(self, mailbox: Mailbox, choices: int, pending: set[int]) -> AsyncIterator[tuple[int, Result]]:
        started = time.monotonic()
        next_index = [0] * choices
        last_at = [started] * choices
        while pending:
            choice, result = await mailbox.get()
            if choice not in pending:
                continue
            clock = time.monotonic()
            if isinstance(result, Token):
                # After a migration the new worker may repeat the last token the old one sent.
                if result.index < next_index[choice]:
                    continue
                (metrics.ITL if next_index[choice] else metrics.TTFT).observe(clock - last_at[choice])
                next_index[choice], last_at[choice] = result.index + 1, clock
                metrics.TOKENS_OUT.inc()
                self.throughput.add(1)
            else:
                pending.discard(choice)
                metrics.E2E.observe(clock - started)
                if isinstance(result, Done):
                    metrics.TOKENS_IN.inc(result.prompt_tokens)
                    metrics.QUEUE.observe(result.queue_s)
            yield choice, result

    async def _close(self, submits: list[Submit], pending: set[int]) -> None:
        """Cancel what still runs and stamp how each request left the gateway."""
        pipe = self.redis.pipeline(transaction=False)
        for choice, submit in enumerate(submits):
            if choice in pending:
                pipe.xadd(self.keys.requests, {PAYLOAD: encode(Cancel(submit.request_id), self.limit)},
                          maxlen=REQUEST_STREAM_MAXLEN, approximate=True)
            self._stamp(pipe, submit.request_id, "cancelled" if choice in pending else "delivered")
        await pipe.execute()

    def _stamp(self, pipe: Pipeline, request_id: str, hop: str) -> None:
        stamp(pipe, self.keys, request_id, hop, "gateway", self.settings.trace_ttl)

    async def trace(self, request_id: str) -> list[TraceEvent]:
        raw = await self.redis.lrange(self.keys.trace(request_id), 0, -1)
        events = [decode(item, TraceEvent, self.limit) for item in raw]
        return sorted(events, key=lambda event: event.at)

    async def queue_depth(self) -> int:
        return max(int(await self.redis.get(self.keys.queued) or 0), 0)

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
