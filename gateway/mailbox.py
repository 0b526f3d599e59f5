"""One HTTP request's results between the pub/sub pump and its handler, bounded in bytes.

A client that stops reading leaves its handler stuck in `send` while results keep
arriving; past `limit` bytes the mailbox drops what it holds, tells its owner (who
cancels the request) and from then on holds only a `client_too_slow` error per choice,
which the handler sends if the client ever reads again. Results are kept as the raw
payloads that arrived, framed in one bytearray and decoded when taken, so that the
bytes counted are the memory held."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

from common.errors import ErrorCode
from common.protocol import Error, ProtocolError, Result, decode, encode

log = logging.getLogger("gateway")

# Each payload is framed as (choice, length).
FRAME = struct.Struct("<HI")


@dataclass
class Mailbox:
    request_ids: list[str]
    message_limit: int
    # Bytes held before the request counts as abandoned; 0: no bound.
    limit: int = 0
    on_overflow: Callable[[], None] | None = None
    # What its results decode as: a generation's Results, or a worker's Reply (tokenize).
    kind: object = Result
    overflowed: bool = False
    data: bytearray = field(default_factory=bytearray)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def deliver(self, choice: int, payload: bytes) -> None:
        """A result as published; the pump calls this, so it never waits."""
        if self.overflowed:
            return
        # The first result is always taken, however large: the bound is on what waits behind it.
        if self.limit and self.data and len(self.data) + FRAME.size + len(payload) > self.limit:
            self._overflow()
            return
        self._append(choice, payload)

    def put(self, choice: int, result: Result) -> None:
        """An outcome the gateway decides itself (the connection to Redis broke)."""
        self._append(choice, encode(result, self.message_limit))

    async def get(self) -> tuple[int, Result]:
        while True:
            while not self.data:
                self.ready.clear()
                await self.ready.wait()
            choice, size = FRAME.unpack_from(self.data)
            payload = bytes(self.data[FRAME.size:FRAME.size + size])
            del self.data[:FRAME.size + size]
            try:
                return choice, decode(payload, self.kind, self.message_limit)
            except ProtocolError as exc:
                log.error("dropped a malformed result", extra={"request_id": self.request_ids[choice],
                                                               "error": str(exc)})

    def empty(self) -> bool:
        return not self.data

    def _append(self, choice: int, payload: bytes) -> None:
        self.data += FRAME.pack(choice, len(payload))
        self.data += payload
        self.ready.set()

    def _overflow(self) -> None:
        log.warning("client too slow: its results were dropped and the request cancelled",
                    extra={"request_id": self.request_ids[0], "buffered_bytes": len(self.data)})
        self.data = bytearray()
        self.overflowed = True
        slow = Error(ErrorCode.CLIENT_TOO_SLOW, f"the client did not read its stream: over {self.limit} bytes of "
                     "results waited for it, so the request was cancelled")
        for choice in range(len(self.request_ids)):
            self.put(choice, slow)
        if self.on_overflow is not None:
            self.on_overflow()


Route = tuple[Mailbox, int]  # a mailbox, and the choice whose results a channel carries


class Router(Protocol):
    """What carries results from Redis to mailboxes: one pub/sub connection to one server (gateway/results.py), or
    one per node of a Redis Cluster (gateway/shards.py). The gateway's bus and streams see only this."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def check(self) -> None:
        """Raise while results cannot be received (for /health)."""

    def open(self, request_ids: list[str], on_overflow: Callable[[], None] | None = None,
             kind: object = Result) -> AbstractAsyncContextManager[Mailbox]:
        """Subscribe to each request's channel; usable once Redis has confirmed every subscription."""


class Readers:
    """The mailboxes reading each results channel on one pub/sub connection. A channel is subscribed once
    however many of this gateway's clients read it (a stream resumed twice at once, a resume beside a
    half-open first connection), and each of them gets every result: `add` says when to subscribe, `remove`
    when the last reader has gone and the channel may be unsubscribed."""

    def __init__(self) -> None:
        self._routes: dict[bytes, list[Route]] = {}

    def __len__(self) -> int:
        """Channels read."""
        return len(self._routes)

    def add(self, channel: bytes, route: Route) -> bool:
        """Whether `route` is the channel's first reader."""
        routes = self._routes.setdefault(channel, [])
        routes.append(route)
        return len(routes) == 1

    def remove(self, channel: bytes, route: Route) -> bool:
        """Whether the channel has no reader left (once `route` was one of its readers)."""
        routes = self._routes.get(channel)
        if not routes or not any(r is route for r in routes):
            return False
        routes[:] = [r for r in routes if r is not route]
        if routes:
            return False
        del self._routes[channel]
        return True

    def deliver(self, channel: bytes, payload: bytes) -> None:
        for mailbox, choice in self._routes.get(channel, ()):
            mailbox.deliver(choice, payload)

    def drop(self, channel: bytes, error: Error) -> None:
        """The channel ends for all its readers with `error`."""
        for mailbox, choice in self._routes.pop(channel, ()):
            mailbox.put(choice, error)

    def fail(self, error: Error) -> None:
        """Every channel ends for all its readers with `error`."""
        routes, self._routes = self._routes, {}
        for readers in routes.values():
            for mailbox, choice in readers:
                mailbox.put(choice, error)
