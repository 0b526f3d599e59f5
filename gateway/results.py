"""Per-request delivery: one shared pub/sub connection per gateway process, one
mailbox per HTTP request (shared by its n choices, bounded in bytes: gateway/mailbox.py),
and a pump task that routes each published result to its mailbox tagged with the
choice it belongs to.

The pub/sub connection is a plain asyncio stream parsed by hiredis: each read
returns every message that arrived meanwhile, and the pump routes them all in one
loop. redis-py's `PubSub` spends several coroutine layers on every message, a
fifth of the gateway's time at 1,000 streams; its commands need no reply but the
subscription's confirmation, which arrives through the pump like any message.

With Sentinel, each connection goes to the server Sentinel names as the primary. In a Redis Cluster
the results travel by sharded pub/sub instead, one connection per node: gateway/shards.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from common.clients import RedisTarget, async_sentinel, parse_redis_url
from common.errors import ErrorCode
from common.keys import Keys
from common.protocol import Error, Result
from gateway.mailbox import Mailbox, Readers

log = logging.getLogger("gateway")

READ_BYTES = 1 << 16
CONNECT_SECONDS = 5.0
FIRST_CONNECT_SECONDS = 5.0
MAX_BACKOFF = 5.0
PRIMARY_CHECK_SECONDS = 0.5
LOST = Error(ErrorCode.REDIS_UNAVAILABLE, "the connection to Redis broke while the request was in flight")
NODE_LOST = Error(ErrorCode.REDIS_UNAVAILABLE, "a Redis cluster node was lost while the request was in flight")
MOVED = Error(ErrorCode.REDIS_UNAVAILABLE, "the request's results channel moved to another Redis cluster node "
              "while the request was in flight")
# The errors a gateway puts in a mailbox itself, which nothing in Redis records (gateway/streams.py does).
BROKEN = (LOST, NODE_LOST, MOVED)


def command(*parts: str | bytes) -> bytes:
    """One Redis command in RESP, the protocol's request form."""
    encoded = [part.encode() if isinstance(part, str) else part for part in parts]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in encoded)


async def open_node(host: str, port: int, target: RedisTarget, primary: bool = False
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to one server of a cluster or of Sentinel's, authenticated before it is handed
    over; with `primary`, refused unless the server says it is a primary (during a failover Sentinel may
    still name the old one for a moment)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_SECONDS)
    try:
        expected = 0
        if target.password:
            writer.write(command("AUTH", *target.credentials().values()))
            expected += 1
        if primary:
            writer.write(command("ROLE"))
            expected += 1
        replies = await asyncio.wait_for(_replies(reader, expected), CONNECT_SECONDS)
        for reply in replies:
            if isinstance(reply, hiredis.ReplyError):
                raise RedisConnectionError(f"Redis at {host}:{port} refused the pub/sub connection: {reply}")
        if primary and not (isinstance(replies[-1], list) and replies[-1][:1] == [b"master"]):
            raise RedisConnectionError(f"Redis at {host}:{port} is not the primary (a failover is under way)")
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def _replies(reader: asyncio.StreamReader, count: int) -> list[object]:
    parser, replies = hiredis.Reader(), []
    while len(replies) < count:
        data = await reader.read(READ_BYTES)
        if not data:
            raise RedisConnectionError("Redis closed the connection")
        parser.feed(data)
        while (reply := parser.gets()) is not False:
            replies.append(reply)
    return replies


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to the Redis that `url` names (redis://, rediss://, unix://). AUTH, when the URL
    carries a password, is sent at once; its reply is the first the reader sees."""
    params = parse_url(url)
    if "path" in params:
        reader, writer = await asyncio.open_unix_connection(params["path"])
    else:
        tls = ssl.create_default_context() if params.get("connection_class") is SSLConnection else None
        reader, writer = await asyncio.open_connection(params.get("host", "localhost"), params.get("port", 6379),
                                                       ssl=tls)
    if params.get("password"):
        writer.write(command("AUTH", *filter(None, [params.get("username"), params["password"]])))
    return reader, writer


class ResultRouter:
    """The gateway's results from one server: a Router (gateway/mailbox.py) over one pub/sub connection."""

    def __init__(self, redis_url: str, keys: Keys, limit: int, buffer_bytes: int = 0) -> None:
        self.redis_url = redis_url
        self.target = parse_redis_url(redis_url)
        # With Sentinel, each connection goes to the server it names as the primary at that moment.
        self.sentinel = async_sentinel(self.target) if self.target.mode == "sentinel" else None
        self.keys = keys
        self.limit = limit
        self.buffer_bytes = buffer_bytes
        self.writer: asyncio.StreamWriter | None = None  # set while connected
        self.connected = asyncio.Event()
        self.readers = Readers()
        # Per channel, a future per SUBSCRIBE sent and not yet confirmed, oldest first (Redis confirms in order).
        self.confirmations: dict[bytes, deque[asyncio.Future[None]]] = {}
        self.pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the pump and give it a moment to connect; without Redis the gateway still starts, and
        answers 503 until the pump gets through."""
        self.pump = asyncio.create_task(self._pump())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.connected.wait(), FIRST_CONNECT_SECONDS)

    def check(self) -> None:
        """A single server's reachability is its ping's (the Bus's ping)."""

    async def stop(self) -> None:
        if self.pump:
            self.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pump

    @asynccontextmanager
    async def open(self, request_ids: list[str], on_overflow: Callable[[], None] | None = None,
                   kind: object = Result) -> AsyncIterator[Mailbox]:
        """Subscribe to each request's channel and wait until Redis confirms them all, so
        that nothing published after this returns can be missed. `on_overflow` is called
        (from the pump) if the mailbox overflows because its reader stopped taking results."""
        if self.writer is None:
            raise RedisConnectionError("no connection to Redis")
        channels = [self.keys.results(rid).encode() for rid in request_ids]
        mailbox = Mailbox(request_ids, self.limit, self.buffer_bytes, on_overflow, kind)
        routes = [(mailbox, choice) for choice in range(len(channels))]
        fresh = [channel for channel, route in zip(channels, routes, strict=True) if self.readers.add(channel, route)]
        loop = asyncio.get_running_loop()
        for channel in fresh:
            self.confirmations.setdefault(channel, deque()).append(loop.create_future())
        # A channel another reader subscribed is ready once its latest SUBSCRIBE is confirmed. Shielded: the
        # confirmation is shared, and a reader that leaves must not cancel it for the others.
        waits = [asyncio.shield(pending[-1]) for c in channels if (pending := self.confirmations.get(c))]
        try:
            if fresh:
                self.writer.write(command("SUBSCRIBE", *fresh))
            await asyncio.gather(*waits)
            yield mailbox
        finally:
            gone = [c for c, route in zip(channels, routes, strict=True) if self.readers.remove(c, route)]
            if gone and self.writer is not None:
                self.writer.write(command("UNSUBSCRIBE", *gone))

    async def _pump(self) -> None:
        """Route messages; when the connection breaks, fail every request in flight and reconnect."""
        backoff = 0.1
        while True:
            try:
                reader, writer, primary = await self._connect()
                backoff = 0.1
                await self._route(reader, writer, primary)
            except (RedisError, OSError) as exc:
                log.warning("pub/sub connection lost; failing requests in flight",
                            extra={"error": str(exc), "in_flight": len(self.readers), "retry_in_s": backoff})
                self._fail_all()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, tuple[str, int] | None]:
        """A connection, and under Sentinel the primary's address it went to."""
        if self.sentinel is None:
            return *await connect(self.redis_url), None
        host, port = await self.sentinel.discover_master(self.target.service)
        return *await open_node(host, port, self.target, primary=True), (host, port)

    async def _route(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     primary: tuple[str, int] | None) -> None:
        """Route whatever arrives until the connection ends, which raises."""
        self.writer = writer
        self.connected.set()
        watch = asyncio.create_task(self._watch(primary, writer)) if primary else None
        try:
            parser = hiredis.Reader()
            while data := await reader.read(READ_BYTES):
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    self._handle(reply)
            raise RedisConnectionError("Redis closed the connection")
        finally:
            self.writer = None  # before anyone is told: a new request must not subscribe on this connection
            self.connected.clear()
            writer.close()
            if watch is not None:
                watch.cancel()

    async def _watch(self, primary: tuple[str, int], writer: asyncio.StreamWriter) -> None:
        """Close the connection once Sentinel names another primary: the workers publish there from then on,
        while the old primary may go on answering for seconds until Sentinel demotes it."""
        while True:
            await asyncio.sleep(PRIMARY_CHECK_SECONDS)
            try:
                now = await self.sentinel.discover_master(self.target.service)
            except RedisError:
                continue  # no sentinel answers: the connection stands until it breaks
            if tuple(now) != tuple(primary):
                log.warning("Sentinel names another primary; leaving the old one's pub/sub",
                            extra={"old": f"{primary[0]}:{primary[1]}", "new": f"{now[0]}:{now[1]}"})
                writer.close()
                return

    def _fail_all(self) -> None:
        self.readers.fail(LOST)
        for waiting in self.confirmations.values():
            for confirmed in waiting:
                if not confirmed.done():
                    confirmed.set_exception(RedisConnectionError("the connection to Redis broke"))
        self.confirmations.clear()

    def _handle(self, reply: object) -> None:
        """A pub/sub reply: [kind, channel, payload]; anything else is AUTH's answer."""
        if isinstance(reply, hiredis.ReplyError):
            raise RedisConnectionError(f"Redis refused the pub/sub connection: {reply}")
        if not isinstance(reply, list) or len(reply) != 3:
            return
        kind, channel, payload = reply
        if kind == b"message":
            self.readers.deliver(channel, payload)
        elif kind == b"subscribe" and (waiting := self.confirmations.get(channel)):
            confirmed = waiting.popleft()
            if not waiting:
                del self.confirmations[channel]
            if not confirmed.done():
                confirmed.set_result(None)
