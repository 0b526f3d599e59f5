"""Per-request delivery: one shared pub/sub connection per gateway process, a
queue per request_id (its mailbox), and a pump task that routes each published
result to its mailbox."""

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


class ResultRouter:
    def __init__(self, client: aioredis.Redis, keys: Keys, limit: int) -> None:
        self.keys = keys
        self.limit = limit
        self.pubsub = client.pubsub()
        self.mailboxes: dict[bytes, asyncio.Queue[Result]] = {}
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
    async def open(self, request_id: str) -> AsyncIterator[asyncio.Queue[Result]]:
        """Subscribe to the request's channel and wait until Redis confirms it, so
        that nothing published after this returns can be missed."""
        channel = self.keys.results(request_id).encode()
        mailbox: asyncio.Queue[Result] = asyncio.Queue()
        confirmed = asyncio.get_running_loop().create_future()
        self.mailboxes[channel] = mailbox
        self.confirmations[channel] = confirmed
        try:
            await self.pubsub.subscribe(channel)
            await confirmed
            yield mailbox
        finally:
            self.mailboxes.pop(channel, None)
            self.confirmations.pop(channel, None)
            with anyio.CancelScope(shield=True):
                await self.pubsub.unsubscribe(channel)

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
        mailbox = self.mailboxes.get(channel)
        if mailbox is None:
            return
        try:
            mailbox.put_nowait(decode(data, Result, self.limit))
        except ProtocolError as exc:
            log.error("dropped a malformed result", extra={"channel": channel.decode(), "error": str(exc)})
