"""Per-request delivery in a Redis Cluster: sharded pub/sub. A request's results channel lives in its
request's slot (common/keys.py) and its worker SPUBLISHes there (common/resultlog.py), so the
gateway SSUBSCRIBEs on the node that serves that slot: one raw, hiredis-parsed connection per primary,
each with a pump routing its messages to their mailboxes as in gateway/results.py. The cluster client's
slot map says which node serves a channel.

What can go wrong, and what the client then gets (each a `redis_unavailable` error, as when a single
Redis restarts):
- the map is stale (a failover or resharding): the node answers MOVED, and the subscription is made once
  more on the node it names while the map is refreshed;
- the slot moves while the request runs: the node unsubscribes the channel itself (SUNSUBSCRIBE), and that
  request fails;
- a node is lost: every request in flight fails, not only those whose channels were on it, because a
  worker that cannot reach one node drops everything it runs (worker/main.py), may be unable to say so
  (a pipeline that touches the lost node sends nothing at all), and, in a cluster without replicas, no
  node serves until the lost one returns. The gateway holds a link to every primary, used or not, so that
  it sees any loss at once. Until the node answers again, or the slot map no longer names it (a replica
  took over), new requests get 503 at once, as during a single Redis's outage, rather than being admitted
  into a cluster that cannot serve them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError

from common.clients import RedisTarget
from common.keys import Keys
from common.protocol import Error, Result
from common.runtime import REDIS_ERRORS, stop_task
from gateway.mailbox import Mailbox, Readers, Route
from gateway.results import FIRST_CONNECT_SECONDS, MOVED, NODE_LOST, READ_BYTES, command, open_node

log = logging.getLogger("gateway")


PROBE_SECONDS = 0.5

Address = tuple[str, int]


class Redirected(Exception):
    """A node answered MOVED: another node serves the channel's slot. (ASK, for a slot half-way through a
    migration, is refused like any other error: the request gets a 503 and may retry.)"""

    def __init__(self, address: Address) -> None:
        super().__init__(f"moved to {address[0]}:{address[1]}")
        self.address = address


def _refusal(reply: hiredis.ReplyError) -> Exception:
    words = str(reply).split()
    if len(words) == 3 and words[0] == "MOVED":
        host, _, port = words[2].rpartition(":")
        return Redirected((host, int(port)))
    return RedisConnectionError(f"the cluster refused a subscription: {reply}")


@dataclass
class Pending:
    """A command of ours whose reply has not arrived: replies come in the order of the commands."""

    kind: bytes  # b"ssubscribe" or b"sunsubscribe"
    channel: bytes
    reply: asyncio.Future[None] | None = None


class NodeLink:
    """One connection to one node: the channels subscribed on it and their mailboxes."""

    def __init__(self, address: Address, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_lost: Callable[[NodeLink], None]) -> None:
        self.address = address
        self.reader, self.writer = reader, writer
        self.on_lost = on_lost
        self.readers = Readers()
        # The SSUBSCRIBE of each channel not yet confirmed, which later readers of the channel wait for too.
        self.confirming: dict[bytes, asyncio.Future[None]] = {}
        self.pending: deque[Pending] = deque()
        self.alive = True
        self.task = asyncio.create_task(self._pump())

    async def subscribe(self, channel: bytes, route: Route) -> None:
        """Returns once the node has confirmed the channel's subscription (made by this reader or an earlier
        one); raises Redirected or a connection error."""
        if not self.alive:
            raise RedisConnectionError("the connection to the cluster node is closed")
        if self.readers.add(channel, route):
            confirmed = self.confirming[channel] = asyncio.get_running_loop().create_future()
            confirmed.add_done_callback(lambda _: self._confirmed(channel, confirmed))
            self.pending.append(Pending(b"ssubscribe", channel, confirmed))
            self.writer.write(command("SSUBSCRIBE", channel))
        confirmed = self.confirming.get(channel)
        if confirmed is None:
            return
        try:
            # Shielded: the confirmation is shared, and a reader that leaves must not cancel it for the others.
            await asyncio.shield(confirmed)
        except (Redirected, RedisConnectionError):
            self.readers.remove(channel, route)  # no subscription was made
            raise
        except BaseException:  # cancelled: the subscription may still be made, so undo it if nobody else reads
            self.unsubscribe(channel, route)
            raise

    def _confirmed(self, channel: bytes, confirmed: asyncio.Future[None]) -> None:
        if self.confirming.get(channel) is confirmed:
            del self.confirming[channel]

    def unsubscribe(self, channel: bytes, route: Route) -> None:
        if self.readers.remove(channel, route) and self.alive:
            self.pending.append(Pending(b"sunsubscribe", channel))
            self.writer.write(command("SUNSUBSCRIBE", channel))

    async def close(self) -> None:
        await stop_task(self.task)

    async def _pump(self) -> None:
        error = "the node closed the connection"
        try:
            parser = hiredis.Reader()
            while data := await self.reader.read(READ_BYTES):
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    self._handle(reply)
        except (*REDIS_ERRORS, OSError, hiredis.ProtocolError) as exc:
            error = str(exc)
        except asyncio.CancelledError:  # the gateway stops
            self._close()
            raise
        log.warning("pub/sub connection to a cluster node lost",
                    extra={"node": self.name, "error": error, "in_flight": len(self.readers)})
        self._close()
        self.on_lost(self)

    def _close(self) -> None:
        self.alive = False
        self.writer.close()
        self.fail(NODE_LOST)

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def fail(self, error: Error) -> None:
        """End every request routed here with `error`, and every subscription still waiting."""
        self.readers.fail(error)
        if not self.alive:
            while self.pending:
                waiting = self.pending.popleft().reply
                if waiting is not None and not waiting.done():
                    waiting.set_exception(RedisConnectionError("the connection to the cluster node broke"))

    def _handle(self, reply: object) -> None:
        if isinstance(reply, hiredis.ReplyError):
            # Only our commands get error replies, in order: it answers the oldest still waiting.
            waiting = self.pending.popleft() if self.pending else None
            if waiting is not None and waiting.reply is not None and not waiting.reply.done():
                waiting.reply.set_exception(_refusal(reply))
            return
        if not isinstance(reply, list) or len(reply) != 3:
            return
        kind, channel, payload = reply
        if kind == b"smessage":
            self.readers.deliver(channel, payload)
            return
        head = self.pending[0] if self.pending else None
        if head is not None and head.kind == kind and head.channel == channel:
            self.pending.popleft()
            if head.reply is not None and not head.reply.done():
                head.reply.set_result(None)
        elif kind == b"sunsubscribe":
            # Not asked for: the channel's slot moved to another node (resharding, a failover).
            self.readers.drop(channel, MOVED)


class ShardedRouter:
    """The gateway's results in a cluster: a Router (gateway/mailbox.py) with a connection per node."""

    def __init__(self, cluster: Any, target: RedisTarget, keys: Keys, limit: int, buffer_bytes: int = 0) -> None:
        self.cluster = cluster  # a redis.asyncio.RedisCluster: its slot map
        self.target = target
        self.keys = keys
        self.limit = limit
        self.buffer_bytes = buffer_bytes
        self.links: dict[Address, NodeLink] = {}
        self.connecting: dict[Address, asyncio.Task[NodeLink]] = {}
        self.refreshing: asyncio.Task[None] | None = None
        # Primaries whose connection broke or could not be made, until they answer or the map drops them.
        self.down: set[Address] = set()
        self.watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Learn the slot map if the cluster answers; without it the gateway still starts, and answers 503
        until a node does."""
        with contextlib.suppress(*REDIS_ERRORS, OSError):
            await asyncio.wait_for(self.cluster.initialize(), FIRST_CONNECT_SECONDS)
            self._cover()

    async def stop(self) -> None:
        for task in self.connecting.values():
            task.cancel()
        for link in list(self.links.values()):
            await link.close()
        for task in (self.refreshing, self.watcher):
            if task is not None:
                task.cancel()

    def check(self) -> None:
        """Raise while a primary is known to be unreachable."""
        if self.down:
            names = ", ".join(f"{host}:{port}" for host, port in sorted(self.down))
            raise RedisConnectionError(f"Redis cluster node {names} is unreachable")

    @asynccontextmanager
    async def open(self, request_ids: list[str], on_overflow: Callable[[], None] | None = None,
                   kind: object = Result) -> AsyncIterator[Mailbox]:
        """Subscribe to each request's channel on its node and wait until each node confirms, so that
        nothing published after this returns can be missed."""
        self.check()
        mailbox = Mailbox(request_ids, self.limit, self.buffer_bytes, on_overflow, kind)
        channels = [self.keys.results(rid).encode() for rid in request_ids]
        routes = [(mailbox, choice) for choice in range(len(channels))]
        outcomes = await asyncio.gather(*(self._subscribe(channel, route)
                                          for channel, route in zip(channels, routes, strict=True)),
                                        return_exceptions=True)
        subscribed = [(link, channel, route) for link, channel, route in zip(outcomes, channels, routes, strict=True)
                      if isinstance(link, NodeLink)]
        try:
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            yield mailbox
        finally:
            for link, channel, route in subscribed:
                link.unsubscribe(channel, route)

    async def _subscribe(self, channel: bytes, route: Route) -> NodeLink:
        address = await self._address(channel)
        for _ in range(2):
            link = await self._link(address)
            try:
                await link.subscribe(channel, route)
                return link
            except Redirected as redirected:
                address = redirected.address
                self._refresh()
        raise RedisConnectionError("the cluster redirected a subscription twice; its slots are moving")

    async def _address(self, channel: bytes) -> Address:
        """The node that serves the channel's slot, by the cluster client's map."""
        try:
            await self.cluster.initialize()  # once; the client refreshes its map itself after errors
            node = self.cluster.get_node_from_key(channel)
        except REDIS_ERRORS as exc:
            raise RedisConnectionError(f"no Redis cluster node serves the request: {exc}") from exc
        self._cover()
        return node.host, node.port

    async def _link(self, address: Address) -> NodeLink:
        link = self.links.get(address)
        if link is not None and link.alive:
            return link
        try:
            return await asyncio.shield(self._connecting(address))
        except (*REDIS_ERRORS, OSError) as exc:
            raise RedisConnectionError(f"cannot reach Redis cluster node {address[0]}:{address[1]}: {exc}") from exc

    def _connecting(self, address: Address) -> asyncio.Task[NodeLink]:
        """The one attempt under way to connect to `address`; a failed one marks the node down."""
        task = self.connecting.get(address)
        if task is None:
            task = self.connecting[address] = asyncio.create_task(self._connect(address))
            task.add_done_callback(lambda done: self._connected(address, done))
        return task

    def _connected(self, address: Address, task: asyncio.Task[NodeLink]) -> None:
        self.connecting.pop(address, None)
        if not task.cancelled() and task.exception() is not None:
            self._mark_down(address)

    async def _connect(self, address: Address) -> NodeLink:
        reader, writer = await open_node(*address, self.target)
        link = self.links[address] = NodeLink(address, reader, writer, self._lost)
        return link

    def _cover(self) -> None:
        """A link to every primary, whether a request uses it or not, so that the loss of any is seen at once."""
        for node in self.cluster.get_primaries():
            address = (node.host, node.port)
            if address not in self.links and address not in self.down:
                self._connecting(address)

    def _lost(self, link: NodeLink) -> None:
        if self.links.get(link.address) is link:
            del self.links[link.address]
        others = [other for other in self.links.values() if other.readers]
        if others:
            log.warning("cluster node lost; failing the requests in flight on the other nodes too",
                        extra={"node": link.name, "in_flight": sum(len(other.readers) for other in others)})
        for other in others:
            other.fail(NODE_LOST)
        self._mark_down(link.address)

    def _mark_down(self, address: Address) -> None:
        self.down.add(address)
        if self.watcher is None or self.watcher.done():
            self.watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Every PROBE_SECONDS, re-read the slot map and try each node that is down."""
        while self.down:
            await asyncio.sleep(PROBE_SECONDS)
            mapped = await self._reread()
            serving = {(node.host, node.port) for node in self.cluster.get_primaries()}
            for address in list(self.down):
                if (mapped and address not in serving) or await self._answers(address):
                    self.down.discard(address)
                    log.warning("cluster node serves again, or no longer serves any slot",
                                extra={"node": f"{address[0]}:{address[1]}"})
            if mapped:
                self._cover()

    async def _answers(self, address: Address) -> bool:
        try:
            _, writer = await open_node(*address, self.target)
        except (*REDIS_ERRORS, OSError):
            return False
        writer.close()
        return True

    def _refresh(self) -> None:
        """Re-read the slot map in the background (once at a time)."""
        if self.refreshing is None or self.refreshing.done():
            self.refreshing = asyncio.create_task(self._reread())

    async def _reread(self) -> bool:
        try:
            await self.cluster.nodes_manager.initialize()
        except (*REDIS_ERRORS, OSError):
            return False
        return True
