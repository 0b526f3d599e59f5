"""The gateway's side of the bus: admit requests to the queue, keep what a stream needs to be
resumed (its results logs, its lease), end streams (delivered, left to their lease, or cancelled)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable

from redis.asyncio.client import Pipeline

from common import scripts
from common.clients import async_client, is_cluster, parse_redis_url
from common.errors import ErrorCode
from common.journey import stamp
from common.keys import REQUEST_STREAM_MAXLEN, Keys
from common.protocol import (
    Cancel,
    Detokenize,
    Error,
    Heartbeat,
    ModelLoad,
    ProtocolError,
    Result,
    StreamMeta,
    Submit,
    Token,
    Tokenize,
    TraceEvent,
    decode,
    encode,
)
from common.resultlog import LOG_HEAD, publish_results
from common.runtime import REDIS_ERRORS
from common.settings import Settings
from common.streams import StreamWriter
from gateway import metrics
from gateway.leases import Leases
from gateway.mailbox import Router
from gateway.results import ResultRouter
from gateway.shards import ShardedRouter
from gateway.throughput import SharedThroughput

log = logging.getLogger("gateway")

WORKERS_CACHE_SECONDS = 1.0
FLOORS_CACHED = 10_000  # keys whose priority floor is remembered at once
# Room left in a message for what the scheduler wraps around a Submit (a Batch and its id).
SUBMIT_HEADROOM = 1024
# How long a request counts against its key at most, past its queue deadline: a generous bound on its
# run, so that the requests of a gateway that died unannounced stop counting some day.
RUN_BOUND_SECONDS = 3600.0

class Refused(Exception):
    """The request cannot be admitted now (or, for a size, ever); the code says which, and `retry_after` when
    (seconds) it may be."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after = code, message, param, retry_after


POOL_CONNECTIONS = 64
POOL_WAIT_SECONDS = 30.0


class Bus:
    """The gateway's Redis: admission, the results logs and leases of streams, cancellation, and what
    the watching routes read. Streams themselves are gateway/streams.py."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limit = settings.max_message_bytes
        self.keys = Keys(settings.namespace)
        self.streams = StreamWriter(self.keys, self.limit)
        # A burst of a thousand arrivals waits its turn for a connection instead of failing with
        # "Too many connections"; each command holds one for well under a millisecond.
        self.redis = async_client(settings.redis_url, POOL_CONNECTIONS, POOL_WAIT_SECONDS)
        self.cluster = is_cluster(settings.redis_url)
        self.router: Router = (
            ShardedRouter(self.redis, parse_redis_url(settings.redis_url), self.keys, self.limit,
                          settings.client_buffer_bytes) if self.cluster
            else ResultRouter(settings.redis_url, self.keys, self.limit, settings.client_buffer_bytes))
        self.leases = Leases(self.redis, self.keys, settings, self._lapsed)
        self.keyed = any(key.strip() for key in settings.api_keys.split(","))
        self.key_limit = settings.key_max_requests if self.keyed else 0
        # Streams may be resumed: they keep a results log in Redis.
        self.resumable = settings.resume_ttl > 0
        self._workers: tuple[float, list[Heartbeat]] = (0.0, [])
        self._floors: dict[str, tuple[float, int | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.throughput = SharedThroughput(self.redis, self.keys)

    async def start(self) -> None:
        await self.router.start()
        self.leases.start()
        self.throughput.start()

    async def ping(self) -> None:
        """Raises unless Redis answers (in a cluster, also while a node is known to be unreachable)."""
        await self.redis.ping()
        self.router.check()

    async def stop(self) -> None:
        await self.leases.stop()
        await self.throughput.stop()
        await self.router.stop()
        await self.redis.aclose()

    def soon(self, work: Awaitable[None]) -> None:
        """Run `work` in the background (from a callback that cannot wait), keeping a reference to it."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # Admission.

    async def admit(self, submits: list[Submit], meta: StreamMeta | None = None) -> None:
        """Count the requests in and publish them (or raise Refused); with `meta`, a stream that may be
        resumed: its logs and its lease are created in the same step. A batch job's lines (background) count
        against half the queue's bounds (the other half stays for interactive requests), not against their key's
        requests or quotas."""
        payloads = self._payloads(submits)
        background = submits[0].background
        key_limit = 0 if background else self.key_limit
        if key_limit and len(submits) > key_limit:
            raise Refused(ErrorCode.INVALID_VALUE, f"the request asks for {len(submits)} completions (prompts x n); "
                          f"a key may have at most {self.key_limit} queued or running", "n")
        logged = meta is not None and self.resumable
        log_ttl = int((self.settings.resume_ttl + self._wait_seconds(submits)) * 1000) if logged else 0
        lease = self.leases.grace_ms if logged and self.leases.enabled else 0
        header = encode(meta, self.limit) if logged else b""
        logs = [self.keys.log(s.request_id) for s in submits] if log_ttl else []
        if self.cluster and logs:
            await self._open_logs(logs, header, log_ttl)
        pipe = self.redis.pipeline(transaction=False)
        for submit in submits:
            self._stamp(pipe, submit.request_id, "received", model=submit.model)
        # Plain EVAL: Redis caches the compiled script, and unlike a registered Script in a
        # pipeline it costs no SCRIPT EXISTS round trip per request.
        tenant = submits[0].tenant
        keys = [self.keys.queued, self.keys.queued_bytes, self.keys.requests, self.keys.in_flight(tenant),
                self.keys.leases, self.keys.quota(tenant), self.keys.quotas, *([] if self.cluster else logs)]
        pipe.eval(scripts.ADMIT, len(keys), *keys,
                  self.settings.max_queue >> background, self.settings.max_queue_bytes >> background,
                  REQUEST_STREAM_MAXLEN, key_limit,
                  self._wait_seconds(submits) + RUN_BOUND_SECONDS, len(submits), log_ttl, lease, header,
                  "1" if self.keyed and not background else "0", self.settings.key_rpm, self.settings.key_tpm, tenant,
                  *(s.request_id for s in submits), *payloads)
        # A failed trace stamp must not fail an admitted request: only the script's answer counts.
        *_, verdict = await pipe.execute(raise_on_error=False)
        if verdict != b"ok" and self.cluster and logs:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._close_logs(logs)
        if isinstance(verdict, Exception):
            raise verdict
        if verdict != b"ok":
            raise self._refusal(verdict.decode())

    async def _open_logs(self, logs: list[str], header: bytes, log_ttl: int) -> None:
        """A cluster's part of admission that its script cannot do: each log lives in its request's slot."""
        pipe = self.redis.pipeline(transaction=False)
        for i, log_key in enumerate(logs):
            pipe.rpush(log_key, 0, header if i == 0 else b"")
            pipe.pexpire(log_key, log_ttl)
        await pipe.execute()

    async def _close_logs(self, logs: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for log_key in logs:
            pipe.delete(log_key)
        await pipe.execute()

    def _payloads(self, submits: list[Submit]) -> list[bytes]:
        try:
            return [encode(s, self.limit - SUBMIT_HEADROOM) for s in submits]
        except ProtocolError:
            raise Refused(ErrorCode.REQUEST_TOO_LARGE, "the request does not fit one bus message with its fields: "
                          f"each prompt must encode to under {self.limit - SUBMIT_HEADROOM} bytes "
                          "(MAX_MESSAGE_BYTES less room for the scheduler's envelope)") from None

    def _wait_seconds(self, submits: list[Submit]) -> float:
        """The longest the requests may wait in the queue."""
        waits = [s.deadline - s.submitted_at for s in submits if s.deadline]
        return max(waits, default=self.settings.queue_timeout)

    def _refusal(self, verdict: str) -> Refused:
        settings = self.settings
        kind, _, rest = verdict.partition(":")
        if kind in ("rpm", "tpm"):
            quota, _, wait = rest.partition(":")
            what = "requests" if kind == "rpm" else "tokens (prompt and completion)"
            metrics.QUOTA_REFUSED.labels(kind).inc()
            return Refused(ErrorCode.RATE_LIMITED, f"this API key has used its {quota} {what} per minute "
                           f"({'KEY_RPM' if kind == 'rpm' else 'KEY_TPM'} or its own quota); retry in {wait} s",
                           retry_after=int(wait))
        if verdict == "key_limit":
            return Refused(ErrorCode.KEY_LIMIT, f"this API key has {self.key_limit} requests queued or running "
                           "(KEY_MAX_REQUESTS); retry when one ends")
        if verdict == "queue_bytes":
            return Refused(ErrorCode.QUEUE_FULL, f"the queue is full ({settings.max_queue_bytes} bytes of requests "
                           "wait: MAX_QUEUE_BYTES); retry later")
        return Refused(ErrorCode.QUEUE_FULL, f"the queue is full ({settings.max_queue} requests wait); retry later")

    # The results logs.

    async def stream_meta(self, head: str) -> StreamMeta | None:
        """The header of the stream that `head` names, or None (no such stream, expired, or `head` is
        another choice's request_id)."""
        raw = await self.redis.lindex(self.keys.log(head), LOG_HEAD - 1)
        if not raw:
            return None
        try:
            return decode(raw, StreamMeta, self.limit)
        except ProtocolError:
            return None

    async def read_logs(self, request_ids: list[str]) -> list[list[bytes] | None]:
        """Each request's logged results, oldest first; None for a log that is gone."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.lrange(self.keys.log(rid), 0, -1)
        return [entries[LOG_HEAD:] if len(entries) >= LOG_HEAD else None for entries in await pipe.execute()]

    # How streams end, for the gateway: delivered, left to their lease, or cancelled.

    async def finish(self, request_ids: list[str], tenant: str, delivered: list[str], just_ended: bool) -> None:
        """Every choice has ended: the stream's lease goes and its requests stop counting against their key.
        A stream that `just_ended` keeps its logs RESUME_TTL from now (a choice that ended early would
        otherwise go before the others); a replay of an old one leaves their expiry as it is."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in delivered:
            self._stamp(pipe, rid, "delivered")
        self._settle(pipe, request_ids, tenant)
        if self.resumable and just_ended:
            for rid in request_ids:
                pipe.pexpire(self.keys.log(rid), int(self.settings.resume_ttl * 1000))
        await pipe.execute()

    async def detach(self, request_ids: list[str], pending: list[str], delivered: list[str]) -> None:
        """The client left a stream that may be resumed: its lease lapses RESUME_GRACE from now unless a
        client comes back (then the requests still run, and their results are logged meanwhile)."""
        await self.leases.extend([request_ids[0]])
        pipe = self.redis.pipeline(transaction=False)
        for rid in delivered:
            self._stamp(pipe, rid, "delivered")
        for rid in pending:
            self._stamp(pipe, rid, "detached", grace_s=self.settings.resume_grace)
        await pipe.execute()
        metrics.DETACHED.inc()

    async def cancel(self, request_ids: list[str], tenant: str, pending: list[str], delivered: list[str],
                     error: Error | None, logged: bool) -> None:
        """Cancel the `pending` requests wherever they are. With `logged`, `error` goes to their channels and
        logs first, so that a client reading or resuming the stream sees why it ended."""
        pipe = self.redis.pipeline(transaction=False)
        if logged and error is not None and pending:
            payload = encode(error, self.limit)
            publish_results(pipe, self.keys, self.settings, [(rid, payload, "") for rid in pending])
        for rid in pending:
            self.streams.request(pipe, Cancel(rid))
            self._stamp(pipe, rid, "cancelled")
        for rid in delivered:
            self._stamp(pipe, rid, "delivered")
        self._settle(pipe, request_ids, tenant)
        await pipe.execute()

    async def record(self, request_ids: list[str], result: Error) -> None:
        """Publish `result` to each request's channel and log, one request at a time: in a cluster that lost a
        node, a pipeline that touches it sends nothing at all, and the others' logs must still say it."""
        payload = encode(result, self.limit)
        for rid in request_ids:
            with contextlib.suppress(*REDIS_ERRORS, OSError):
                pipe = self.redis.pipeline(transaction=False)
                publish_results(pipe, self.keys, self.settings, [(rid, payload, "")])
                await pipe.execute()

    async def spend(self, tenant: str, tokens: int) -> None:
        """Count `tokens` in the key's quota window (keys on only: without them a tenant is one request)."""
        if self.keyed and tokens > 0:
            await self.redis.eval(scripts.SPEND, 1, self.keys.quota(tenant), tokens)

    def _settle(self, pipe: Pipeline, request_ids: list[str], tenant: str) -> None:
        """The stream needs nothing more: no lease, and its requests stop counting against their key."""
        if self.leases.enabled:
            pipe.zrem(self.keys.leases, request_ids[0])
        if self.key_limit:
            pipe.zrem(self.keys.in_flight(tenant), *request_ids)

    async def _lapsed(self, heads: list[str]) -> None:
        """Streams whose lease lapsed (claimed by this gateway): nobody came back within RESUME_GRACE, or their
        gateway died. Their requests that have not ended are cancelled, with an error in their logs."""
        metas = await asyncio.gather(*(self.stream_meta(head) for head in heads))
        error = Error(ErrorCode.CANCELLED, f"the stream's client left and nobody resumed it within RESUME_GRACE "
                      f"({self.settings.resume_grace:g} s), so the request was cancelled")
        for head, meta in zip(heads, metas, strict=True):
            request_ids = meta.request_ids if meta else [head]
            pending = await self.unfinished(request_ids)
            log.info("stream abandoned", extra={"request_id": head, "pending": len(pending)})
            metrics.ABANDONED.inc()
            await self.cancel(request_ids, meta.tenant if meta else "", pending, [], error, logged=True)

    async def unfinished(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` whose log does not end with their end (a Done or an Error)."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.lindex(self.keys.log(rid), -1)
        last = await pipe.execute()
        return [rid for rid, entry in zip(request_ids, last, strict=True) if not self._ends(entry)]

    def _ends(self, entry: bytes | None) -> bool:
        """Whether a log's last entry is the end of its request (a Done or an Error)."""
        if not entry:
            return False
        try:
            return not isinstance(decode(entry, Result, self.limit), Token)
        except ProtocolError:
            return False

    def _stamp(self, pipe: Pipeline, request_id: str, hop: str, **detail: str | int | float) -> None:
        stamp(pipe, self.keys, request_id, hop, "gateway", self.settings.trace_ttl, **detail)

    async def stamp(self, request_ids: list[str], hop: str, **detail: str | int | float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            self._stamp(pipe, rid, hop, **detail)
        await pipe.execute()

    async def tell(self, worker_id: str, message: Tokenize | Detokenize) -> None:
        """A question for one worker (not a request: the scheduler has no part in it), into its inbox."""
        pipe = self.redis.pipeline(transaction=False)
        self.streams.inbox(pipe, worker_id, message)
        await pipe.execute()

    # What the watching routes read.

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
        if time.monotonic() - fetched_at >= WORKERS_CACHE_SECONDS:
            raw = await self.redis.hget(self.keys.priority_floors, tenant)
            floor = int(raw) if raw is not None and raw.lstrip(b"-").isdigit() else None
            if len(self._floors) >= FLOORS_CACHED:
                self._floors.clear()
            self._floors[tenant] = (time.monotonic(), floor)
        return floor

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
