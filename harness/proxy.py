"""The network between one service and a Redis behind Sentinel, made to misbehave on demand (the nemesis's
network faults, bench/nemesis.py).

A service under Sentinel asks the sentinels where the primary is and connects there itself, so a proxy in front
of it must answer for the sentinels too: this one listens as a sentinel that names the proxy's own data port as
the primary, and joins each connection made to that port to the server the real sentinels name as primary at
that moment. Point the service's REDIS_URL at `url`. Then `delay(seconds)` holds every chunk that long in each
direction (sentinel answers included), `cut()` holds everything until `heal()` (a partition that TCP outlives:
what was sent arrives once the network heals, if the ends still wait for it), and `heal()` ends either.
`undelivered(arrived_before)` counts what the data port took in before a moment and has not yet handed on: 0 once
the writes a cut held back are with Redis."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque

import hiredis

from llmserve.processes import free_port

READ_BYTES = 1 << 16
POLL_S = 0.005


def resp(value: object) -> bytes:
    """A reply as hiredis read it (RESP2 or RESP3), in RESP3 again."""
    if value is None:
        return b"_\r\n"
    if isinstance(value, hiredis.ReplyError):
        return b"-%s\r\n" % str(value).encode()
    if isinstance(value, bool):
        return b"#t\r\n" if value else b"#f\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, float):
        return b",%r\r\n" % value
    if isinstance(value, dict):
        return b"%%%d\r\n" % len(value) + b"".join(resp(k) + resp(v) for k, v in value.items())
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(resp(item) for item in value)
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


class Replies:
    """Commands to one server over one connection, their replies as hiredis reads them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.parser = reader, writer, hiredis.Reader()

    async def ask(self, command: list[bytes]) -> object:
        self.writer.write(b"*%d\r\n" % len(command) + b"".join(resp(part) for part in command))
        while (reply := self.parser.gets()) is False:
            data = await self.reader.read(READ_BYTES)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.parser.feed(data)
        return reply


class SentinelProxy:
    def __init__(self, sentinel_ports: list[int], service: str) -> None:
        self.sentinel_ports, self.service = sentinel_ports, service
        self.port, self.data_port = free_port(), free_port()
        self.delay_s = 0.0
        self.held = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="redis-proxy", daemon=True)
        self.servers: list[asyncio.Server] = []
        self.open: set[asyncio.StreamWriter] = set()  # every connection's writer, each end
        # Per direction of each data connection: the arrival times of the chunks not yet handed on, and its writer.
        self.pending: list[tuple[deque[float], asyncio.StreamWriter]] = []

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}"

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    def stop(self) -> None:
        self.heal()
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def cut(self) -> None:
        self.held = True

    def heal(self) -> float:
        """The network as it was; returns the moment (time.monotonic()) it healed."""
        self.delay_s, self.held = 0.0, False
        return time.monotonic()

    def undelivered(self, arrived_before: float = math.inf) -> int:
        """The chunks through the data port, either way, that arrived before `arrived_before` and are not yet
        written to their socket: still held, or in the proxy's write buffer (one more while that holds bytes). A
        connection that broke meanwhile counts for nothing (what it held is gone with it)."""

        def buffered(writer: asyncio.StreamWriter) -> bool:
            return not writer.transport.is_closing() and writer.transport.get_write_buffer_size() > 0

        async def count() -> int:
            return sum(sum(at < arrived_before for at in stamps) + buffered(writer) for stamps, writer in self.pending)

        return asyncio.run_coroutine_threadsafe(count(), self.loop).result(10)

    async def _listen(self) -> None:
        self.servers = [await asyncio.start_server(self._sentinel, "127.0.0.1", self.port),
                        await asyncio.start_server(self._join, "127.0.0.1", self.data_port)]

    async def _close(self) -> None:
        """Close every connection, and let each handler end on its own (cancelling a connection's handler trips
        asyncio's server callback)."""
        for server in self.servers:
            server.close()
        for writer in list(self.open):
            writer.close()
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=5)

    async def _held(self, since: float) -> None:
        """Until a chunk that arrived at `since` may go on."""
        while self.held or time.monotonic() < since + self.delay_s:
            await asyncio.sleep(POLL_S)

    async def _sentinel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer as a sentinel, over a connection to a real one: its replies, but with this proxy's data port
        for the primary's address."""
        self.open.add(writer)
        upstream = await self._a_sentinel()
        if upstream is None:
            writer.close()
            return
        self.open.add(upstream.writer)
        parser = hiredis.Reader()
        try:
            while data := await reader.read(READ_BYTES):
                arrived = time.monotonic()
                parser.feed(data)
                while (command := parser.gets()) is not False:
                    answer = self._as_proxy(command, await upstream.ask(command))
                    await self._held(arrived)
                    writer.write(resp(answer))
                    await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            for end in (writer, upstream.writer):
                end.close()
                self.open.discard(end)

    async def _a_sentinel(self) -> Replies | None:
        for port in self.sentinel_ports:
            with contextlib.suppress(ConnectionError, OSError):
                return Replies(*await asyncio.open_connection("127.0.0.1", port))
        return None

    def _as_proxy(self, command: list[bytes], reply: object) -> object:
        said = [part.upper() for part in command[:2]]
        if said == [b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME"] and isinstance(reply, list):
            return [b"127.0.0.1", str(self.data_port).encode()]
        if said == [b"SENTINEL", b"MASTERS"] and isinstance(reply, list):
            return [self._master_as_proxy(master) for master in reply]
        return reply

    def _master_as_proxy(self, master: list[bytes] | dict[bytes, bytes]) -> list[bytes] | dict[bytes, bytes]:
        fields = master if isinstance(master, dict) else dict(zip(master[::2], master[1::2], strict=True))
        if fields.get(b"name") == self.service.encode():
            fields = {**fields, b"ip": b"127.0.0.1", b"port": str(self.data_port).encode()}
        return fields if isinstance(master, dict) else [item for pair in fields.items() for item in pair]

    async def _primary(self) -> tuple[str, int] | None:
        """The address the real sentinels give for the primary now."""
        upstream = await self._a_sentinel()
        if upstream is None:
            return None
        try:
            address = await upstream.ask([b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME", self.service.encode()])
        except (ConnectionError, OSError):
            return None
        finally:
            upstream.writer.close()
        return (address[0].decode(), int(address[1])) if isinstance(address, list) else None

    async def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Join a connection to the primary the sentinels name now, through the faults."""
        self.open.add(writer)
        primary = await self._primary()
        try:
            if primary is None:
                raise ConnectionError("no sentinel names a primary")
            upstream_reader, upstream = await asyncio.open_connection(*primary)
        except (ConnectionError, OSError):
            writer.close()
            self.open.discard(writer)
            return
        self.open.add(upstream)
        await asyncio.gather(self._pipe(reader, upstream), self._pipe(upstream_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: each chunk stamped as it arrives and sent once the faults let it, in order."""
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        entry = (deque(), writer)  # the arrival times of the chunks taken in and not yet written
        self.pending.append(entry)

        async def send() -> None:
            try:
                while (chunk := await chunks.get())[1]:
                    await self._held(chunk[0])
                    writer.write(chunk[1])
                    await writer.drain()
                    entry[0].popleft()
            finally:  # all sent, or never to be: nothing undelivered is left to wait for
                entry[0].clear()

        sender = asyncio.create_task(send())
        try:
            while (data := await reader.read(READ_BYTES)) and not sender.done():  # done: its end is gone
                now = time.monotonic()
                entry[0].append(now)
                chunks.put_nowait((now, data))
            chunks.put_nowait((time.monotonic(), b""))
            await sender
        except (ConnectionError, OSError):
            sender.cancel()
        finally:
            self.pending.remove(entry)
            writer.close()
            self.open.discard(writer)
