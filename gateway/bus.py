"""The gateway's side of the bus: publish a request, receive its results, cancel it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import redis.asyncio as aioredis

from common.protocol import PAYLOAD, Cancel, Heartbeat, Keys, ProtocolError, Result, Submit, Token, decode, encode
from common.settings import Settings
from gateway.results import ResultRouter

REQUEST_STREAM_MAXLEN = 100_000


class Bus:
    def __init__(self, settings: Settings) -> None:
        self.limit = settings.max_message_bytes
        self.keys = Keys(settings.namespace)
        self.redis = aioredis.from_url(settings.redis_url)
        self.router = ResultRouter(self.redis, self.keys, self.limit)

    async def start(self) -> None:
        await self.router.start()

    async def stop(self) -> None:
        await self.router.stop()
        await self.redis.aclose()

    async def results(self, submit: Submit) -> AsyncIterator[Result]:
        """Yield the request's results up to its Done or Error. A consumer that stops
        early (the client went away) cancels the request wherever it is."""
        ended = False
        async with self.router.open(submit.request_id) as mailbox:
            await self._send(self.keys.requests, submit)
            try:
                while not ended:
                    result = await mailbox.get()
                    ended = not isinstance(result, Token)
                    yield result
            finally:
                if not ended:
                    with anyio.CancelScope(shield=True):
                        await self._send(self.keys.requests, Cancel(submit.request_id))

    async def _send(self, stream: str, message: Submit | Cancel) -> None:
        await self.redis.xadd(stream, {PAYLOAD: encode(message, self.limit)},
                              maxlen=REQUEST_STREAM_MAXLEN, approximate=True)

    async def live_workers(self) -> list[Heartbeat]:
        ids = await self.redis.smembers(self.keys.workers)
        if not ids:
            return []
        beats = await self.redis.mget([self.keys.heartbeat(i.decode()) for i in ids])
        workers = []
        for raw in beats:
            if raw is not None:
                try:
                    workers.append(decode(raw, Heartbeat, self.limit))
                except ProtocolError:
                    continue
        return workers
