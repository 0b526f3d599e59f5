"""Per-request delivery: one shared pub/sub connection per gateway process, one
mailbox per HTTP request (shared by its n choices), and a pump task that routes
each published result to its mailbox tagged with the choice it belongs to."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from common.protocol import Error, Keys, ProtocolError, Result, decode

log = logging.getLogger("gateway")

Mailbox = asyncio.Queue[tuple[int, Result]]


MAX_BACKOFF = 5.0
LOST = Error("redis_unavailable", "the connection to Redis broke while the request was in flight")


class ResultRouter:
    def __init__(self, redis_url: str, keys: Keys, limit: int) -> None:
        self.keys = keys
        self.limit = limit
        # No silent retries: a broken connection must surface, since whatever was published
        # meanwhile is gone and the requests in flight have to be told.
        self.client = aioredis.from_url(redis_url, retry=Retry(NoBackoff(), 0), socket_timeout=None)
        self.pubsub = self.client.pubsub()
        self.routes: dict[bytes, tuple[Mailbox, int]] = {}
        self.confirmations: dict[bytes, asyncio.Future[None]] = {}
        self.pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.pump = asyncio.create_task(self._pump())

    async def stop(self) -> None:
        if self.pump:
            self.pump.cancel()
        await self.pubsub.aclose()
        await self.client.aclose()

    @asynccontextmanager
    async def open(self, request_ids: list[str]) -> AsyncIterator[Mailbox]:
        """Subscribe to each request's channel and wait until Redis confirms them all, so
        that nothing published after this returns can be missed."""
        channels = [self.keys.results(rid).encode() for rid in request_ids]
        mailbox: Mailbox = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for choice, channel in enumerate(channels):
            self.routes[channel] = (mailbox, choice)
            self.confirmations[channel] = loop.create_future()
        waits = [self.confirmations[c] for c in channels]
        try:
            await self.pubsub.subscribe(*channels)
            await asyncio.gather(*waits)
            yield mailbox
        finally:
            for channel in channels:
                self.routes.pop(channel, None)
                self.confirmations.pop(channel, None)
            with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                await self.pubsub.unsubscribe(*channels)

    async def _pump(self) -> None:
        """Route messages; when the connection breaks, fail every request in flight and reconnect."""
        backoff = 0.1
        while True:
            try:
                # The pub/sub connection needs a subscription before it can be read from.
                await self.pubsub.subscribe(f"{self.keys.ns}:gateway:{uuid.uuid4().hex}")
                backoff = 0.1
                while True:
                    message = await self.pubsub.get_message(timeout=None)
                    if message is not None:
                        self._handle(message)
            except (RedisError, OSError) as exc:
                log.warning("pub/sub connection lost; failing requests in flight",
                            extra={"error": str(exc), "in_flight": len(self.routes), "retry_in_s": backoff})
                self._fail_all()
                await self.pubsub.aclose()
                self.pubsub = self.client.pubsub()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _fail_all(self) -> None:
        for mailbox, choice in self.routes.values():
            mailbox.put_nowait((choice, LOST))
        for confirmed in self.confirmations.values():
            if not confirmed.done():
                confirmed.set_exception(RedisError("the connection to Redis broke"))
        self.routes.clear()
        self.confirmations.clear()

    def _handle(self, message: dict) -> None:
        channel = message["channel"]
        if message["type"] == "subscribe":
            confirmed = self.confirmations.pop(channel, None)
            if confirmed and not confirmed.done():
                confirmed.set_result(None)
        elif message["type"] == "message":
            self._deliver(channel, message["data"])

    def _deliver(self, channel: bytes, data: bytes) -> None:
        route = self.routes.get(channel)
        if route is None:
            return
        mailbox, choice = route
        try:
            mailbox.put_nowait((choice, decode(data, Result, self.limit)))
        except ProtocolError as exc:
            log.error("dropped a malformed result", extra={"channel": channel.decode(), "error": str(exc)})
