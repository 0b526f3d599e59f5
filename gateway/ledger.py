"""The ledger of a stream's life in Redis after admission: its results logs (read, replayed, kept RESUME_TTL) and
how it ends (delivered, left to its lease, cancelled), with each hop stamped and the key's count and tokens
settled."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from common import scripts
from common.errors import ErrorCode
from common.journey import stamp
from common.keys import Keys
from common.protocol import Cancel, Error, ProtocolError, Result, StreamMeta, Token, decode, encode
from common.resultlog import LOG_HEAD, publish_results
from common.runtime import REDIS_ERRORS
from common.settings import GatewaySettings
from common.streams import StreamWriter
from gateway import metrics
from gateway.leases import Leases

log = logging.getLogger("gateway")

# How long a stream's count of the tokens counted outlives RESUME_TTL and RESUME_GRACE: past its last reader's end.
SPENT_MARGIN_SECONDS = 60


class Ledger:
    def __init__(self, redis: Redis, keys: Keys, settings: GatewaySettings, leases: Leases) -> None:
        self.redis, self.keys, self.settings, self.leases = redis, keys, settings, leases
        self.limit, self.key_limit = settings.max_message_bytes, settings.key_limit()
        self.keyed = settings.keyed()
        self.streams = StreamWriter(keys, self.limit)

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

    async def finish(self, request_ids: list[str], tenant: str, delivered: list[str], just_ended: bool) -> None:
        """Every choice has ended: the stream's lease goes and its requests stop counting against their key.
        A stream that `just_ended` keeps its logs RESUME_TTL from now (a choice that ended early would
        otherwise go before the others); a replay of an old one leaves their expiry as it is."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in delivered:
            self._stamp(pipe, rid, "delivered")
        self._settle(pipe, request_ids, tenant)
        if self.settings.resumable() and just_ended:
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

    async def spend(self, tenant: str, head: str, used: list[tuple[int, int]], logged: bool) -> None:
        """Count what a reader of stream `head` saw of each choice (its tokens, its prompt's once it ended) in the
        key's quota window (keys on only: without them a tenant is one request). A `logged` stream may have had
        other readers (a resume, an idempotent retry): what one of them counted already is not counted again, for
        as long as anyone may still read the stream."""
        if self.keyed and any(tokens or prompt for tokens, prompt in used):
            keys = [self.keys.quota(tenant), *([self.keys.spent(head)] if logged else [])]
            expiry = int(self.settings.resume_ttl + self.settings.resume_grace) + SPENT_MARGIN_SECONDS
            await self.redis.eval(scripts.SPEND, len(keys), *keys, expiry, *(n for pair in used for n in pair))

    def _settle(self, pipe: Pipeline, request_ids: list[str], tenant: str) -> None:
        """The stream needs nothing more: no lease, and its requests stop counting against their key."""
        if self.leases.enabled:
            pipe.zrem(self.keys.leases, request_ids[0])
        if self.key_limit:
            pipe.zrem(self.keys.in_flight(tenant), *request_ids)

    async def lapsed(self, heads: list[str]) -> None:
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
