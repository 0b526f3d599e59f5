"""The gateway's side of the bus: admit requests to the queue, receive their
results, cancel what a client abandons."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from common.errors import ErrorCode
from common.protocol import (
    PAYLOAD,
    REQUEST_STREAM_MAXLEN,
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
from gateway.mailbox import Mailbox
from gateway.results import ResultRouter

WORKERS_CACHE_SECONDS = 1.0
# Room left in a message for what the scheduler wraps around a Submit (a Batch and its id).
SUBMIT_HEADROOM = 1024
# How long a request counts against its key at most, past its queue deadline: a generous bound on its
# run, so that the requests of a gateway that died unannounced stop counting some day.
RUN_BOUND_SECONDS = 3600.0

# Admission and publication in one atomic step: the bounds are exact under any burst, and all
# choices of one HTTP request are admitted together or not at all. Every write comes after every
# check, so a Redis at its memory limit (whose first write fails) is left as it was.
# KEYS: queued count, queued bytes, request stream, the tenant's in-flight set.
# ARGV: max queue, max queue bytes, stream maxlen, key limit (0: none), seconds a request counts
# against its key, n, then n request ids, then n payloads.
_ADMIT = """
local n = tonumber(ARGV[6])
local size = 0
for i = 7 + n, 6 + 2 * n do size = size + #ARGV[i] end
local queued = tonumber(redis.call('GET', KEYS[1]) or '0')
if queued > 0 and queued + n > tonumber(ARGV[1]) then return 'queue_full' end
local queued_bytes = tonumber(redis.call('GET', KEYS[2]) or '0')
if queued_bytes > 0 and queued_bytes + size > tonumber(ARGV[2]) then return 'queue_bytes' end
local limit = tonumber(ARGV[4])
if limit > 0 then
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('ZCARD', KEYS[4]) + n > limit then return 'key_limit' end
  local expiry = now + tonumber(ARGV[5])
  for i = 7, 6 + n do redis.call('ZADD', KEYS[4], expiry, ARGV[i]) end
  redis.call('EXPIREAT', KEYS[4], math.ceil(expiry))
end
redis.call('INCRBY', KEYS[1], n)
redis.call('INCRBY', KEYS[2], size)
for i = 7 + n, 6 + 2 * n do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'm', ARGV[i])
end
return 'ok'
"""


class Refused(Exception):
    """The request cannot be admitted now (or, for a size, ever); the code says which."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class Admission:
    """The requests of one HTTP request on the bus, and which of them still run."""

    submits: list[Submit]
    pending: set[int]
    released: bool = False

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.submits]


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
        self.router = ResultRouter(settings.redis_url, self.keys, self.limit, settings.client_buffer_bytes)
        keyed = any(key.strip() for key in settings.api_keys.split(","))
        self.key_limit = settings.key_max_requests if keyed else 0
        self._workers: tuple[float, list[Heartbeat]] = (0.0, [])
        self._releases: set[asyncio.Task[None]] = set()
        self.throughput = metrics.Throughput()

    async def start(self) -> None:
        await self.router.start()

    async def stop(self) -> None:
        await self.router.stop()
        await self.redis.aclose()

    @asynccontextmanager
    async def session(self, submits: list[Submit]) -> AsyncIterator[AsyncIterator[tuple[int, Result]]]:
        """Admit the requests (or raise Refused) and yield their results as (choice, result)
        up to each one's Done or Error. Leaving early (the client went away, another choice
        failed) cancels every request still running, wherever it is; so does a client that
        stops reading its stream (its mailbox overflows)."""
        admission = Admission(submits, set(range(len(submits))))
        async with self.router.open(admission.request_ids, lambda: self._too_slow(admission)) as mailbox:
            await self._admit(submits)
            metrics.ACTIVE.inc()
            try:
                yield self._results(mailbox, len(submits), admission.pending)
            finally:
                metrics.ACTIVE.dec()
                with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                    await self._release(admission)

    async def _admit(self, submits: list[Submit]) -> None:
        payloads = self._payloads(submits)
        if self.key_limit and len(submits) > self.key_limit:
            raise Refused(ErrorCode.INVALID_VALUE, f"the request asks for {len(submits)} completions (prompts x n); "
                          f"a key may have at most {self.key_limit} queued or running", "n")
        pipe = self.redis.pipeline(transaction=False)
        for submit in submits:
            self._stamp(pipe, submit.request_id, "received")
        # Plain EVAL: Redis caches the compiled script, and unlike a registered Script in a
        # pipeline it costs no SCRIPT EXISTS round trip per request.
        pipe.eval(_ADMIT, 4, self.keys.queued, self.keys.queued_bytes, self.keys.requests,
                  self.keys.in_flight(submits[0].tenant), self.settings.max_queue, self.settings.max_queue_bytes,
                  REQUEST_STREAM_MAXLEN, self.key_limit, self._hold_seconds(submits), len(submits),
                  *(s.request_id for s in submits), *payloads)
        # A failed trace stamp must not fail an admitted request: only the script's answer counts.
        *_, verdict = await pipe.execute(raise_on_error=False)
        if isinstance(verdict, Exception):
            raise verdict
        if verdict != b"ok":
            raise self._refusal(verdict.decode())

    def _payloads(self, submits: list[Submit]) -> list[bytes]:
        try:
            return [encode(s, self.limit - SUBMIT_HEADROOM) for s in submits]
        except ProtocolError:
            raise Refused(ErrorCode.REQUEST_TOO_LARGE, "the request does not fit one bus message with its fields: "
                          f"each prompt must encode to under {self.limit - SUBMIT_HEADROOM} bytes "
                          "(MAX_MESSAGE_BYTES less room for the scheduler's envelope)") from None

    def _hold_seconds(self, submits: list[Submit]) -> float:
        waits = [s.deadline - s.submitted_at for s in submits if s.deadline]
        return max(waits, default=self.settings.queue_timeout) + RUN_BOUND_SECONDS

    def _refusal(self, verdict: str) -> Refused:
        settings = self.settings
        if verdict == "key_limit":
            return Refused(ErrorCode.KEY_LIMIT, f"this API key has {self.key_limit} requests queued or running "
                           "(KEY_MAX_REQUESTS); retry when one ends")
        if verdict == "queue_bytes":
            return Refused(ErrorCode.QUEUE_FULL, f"the queue is full ({settings.max_queue_bytes} bytes of requests "
                           "wait: MAX_QUEUE_BYTES); retry later")
        return Refused(ErrorCode.QUEUE_FULL, f"the queue is full ({settings.max_queue} requests wait); retry later")

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

    def _too_slow(self, admission: Admission) -> None:
        """The client stopped reading: cancel its requests now, though its handler is stuck in `send`."""
        metrics.SLOW_CLIENTS.inc()
        task = asyncio.create_task(self._release_quietly(admission))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_quietly(self, admission: Admission) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._release(admission)

    async def _release(self, admission: Admission) -> None:
        """Once per admission: cancel what still runs, stop counting it against its key, and stamp
        how each request left the gateway."""
        if admission.released:
            return
        admission.released = True
        pipe = self.redis.pipeline(transaction=False)
        for choice, submit in enumerate(admission.submits):
            if choice in admission.pending:
                pipe.xadd(self.keys.requests, {PAYLOAD: encode(Cancel(submit.request_id), self.limit)},
                          maxlen=REQUEST_STREAM_MAXLEN, approximate=True)
            self._stamp(pipe, submit.request_id, "cancelled" if choice in admission.pending else "delivered")
        if self.key_limit:
            pipe.zrem(self.keys.in_flight(admission.submits[0].tenant), *admission.request_ids)
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
