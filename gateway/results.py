"""Per-request delivery: one shared pub/sub connection per gateway process, one
mailbox per HTTP request (shared by its n choices), and a pump task that routes
each published result to its mailbox tagged with the choice it belongs to."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import redis.asyncio as aioredis

from common.protocol import Keys, ProtocolError, Result, decode

log = logging.getLogger("gateway")

Mailbox = asyncio.Queue[tuple[int, Result]]


class ResultRouter:
    def __init__(self, client: aioredis.Redis, keys: Keys, limit: int) -> None:
        self.keys = keys
        self.limit = limit
        self.pubsub = client.pubsub()
        self.routes: dict[bytes, tuple[Mailbox, int]] = {}
        self.confirmations: dict[bytes, asyncio.Future[None]] = {}
        self.pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # The pub/sub connection needs a subscription before it can be read from.
        await self.pubsub.subscribe(f"{self.keys.ns}:gateway:{uuid.uuid4().hex}")
        self.pump = asyncio.create_task(self._pump())

    async def stop(self) -> None:
        if self.pump:
            self.pump.cancel()
        await self.pubsub.aclose()

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
            with anyio.CancelScope(shield=True):
                await self.pubsub.unsubscribe(*channels)

    async def _pump(self) -> None:
        while True:
            message = await self.pubsub.get_message(timeout=None)
            if message is None:
                continue
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
