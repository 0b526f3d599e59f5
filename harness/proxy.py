"""The network between one service and a Redis behind Sentinel, made to misbehave on demand (the nemesis's
network faults, bench/nemesis.py).

A service under Sentinel asks the sentinels where the primary is and connects there itself, so a proxy in front
of it must answer for the sentinels too: this one listens as a sentinel that names the proxy's own data port as
the primary, and joins each connection made to that port to the server the real sentinels name as primary at
that moment. Point the service's REDIS_URL at `url`. Then `delay(seconds)` holds every chunk that long in each
direction (sentinel answers included), `cut()` holds everything until `heal()` (a partition that TCP outlives:
what was sent arrives once the network heals, if the ends still wait for it), and `heal()` ends either."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import hiredis

from llmserve.processes import free_port

READ_BYTES = 1 << 16
POLL_S = 0.005


def resp(value: object) -> bytes:
    """`value` in RESP: lists as arrays, ints as integers, the rest as bulk strings."""
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(resp(item) for item in value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


async def ask(port: int, *parts: str) -> object:
    """One command to a local server; its reply as hiredis reads it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(resp(list(parts)))
        parser = hiredis.Reader()
        while (reply := parser.gets()) is False:
            data = await reader.read(READ_BYTES)
            if not data:
                raise ConnectionError("the sentinel closed the connection")
            parser.feed(data)
        return reply
    finally:
        writer.close()


class SentinelProxy:
    def __init__(self, sentinel_ports: list[int], service: str) -> None:
        self.sentinel_ports, self.service = sentinel_ports, service
        self.port, self.data_port = free_port(), free_port()
        self.delay_s = 0.0
        self.held = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="redis-proxy", daemon=True)
        self.servers: list[asyncio.Server] = []

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

    def heal(self) -> None:
        self.delay_s, self.held = 0.0, False

    async def _listen(self) -> None:
        self.servers = [await asyncio.start_server(self._sentinel, "127.0.0.1", self.port),
                        await asyncio.start_server(self._join, "127.0.0.1", self.data_port)]

    async def _close(self) -> None:
        for server in self.servers:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def _held(self, since: float) -> None:
        """Until a chunk that arrived at `since` may go on."""
        while self.held or time.monotonic() < since + self.delay_s:
            await asyncio.sleep(POLL_S)

    async def _sentinel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer as a sentinel: the real ones' view of the service, with this proxy as its primary's address."""
        parser = hiredis.Reader()
        try:
            while data := await reader.read(READ_BYTES):
                arrived = time.monotonic()
                parser.feed(data)
                while (command := parser.gets()) is not False:
                    answer = await self._answer([part.decode().upper() for part in command])
                    await self._held(arrived)
                    writer.write(answer)
                    await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _answer(self, command: list[str]) -> bytes:
        if command[:2] == ["SENTINEL", "MASTERS"]:
            masters = await self._real("SENTINEL", "MASTERS")
            return resp([self._as_proxy(master) for master in masters])
        if command[:2] == ["SENTINEL", "GET-MASTER-ADDR-BY-NAME"]:
            return resp(["127.0.0.1", str(self.data_port)])
        return b"+PONG\r\n" if command[:1] == ["PING"] else b"+OK\r\n"

    def _as_proxy(self, master: list[bytes]) -> list[bytes]:
        fields = dict(zip(master[::2], master[1::2], strict=True))
        if fields.get(b"name") == self.service.encode():
            fields[b"ip"], fields[b"port"] = b"127.0.0.1", str(self.data_port).encode()
        return [item for pair in fields.items() for item in pair]

    async def _real(self, *command: str) -> list:
        for port in self.sentinel_ports:
            with contextlib.suppress(ConnectionError, OSError):
                reply = await ask(port, *command)
                if isinstance(reply, list):
                    return reply
        return []

    async def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Join a connection to the primary the sentinels name now, through the faults."""
        try:
            address = await self._real("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
            upstream_reader, upstream = await asyncio.open_connection(address[0].decode(), int(address[1]))
        except (ConnectionError, OSError, IndexError):
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, upstream), self._pipe(upstream_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: each chunk stamped as it arrives and sent once the faults let it, in order."""
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while (chunk := await chunks.get())[1]:
                await self._held(chunk[0])
                writer.write(chunk[1])
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while data := await reader.read(READ_BYTES):
                chunks.put_nowait((time.monotonic(), data))
            chunks.put_nowait((time.monotonic(), b""))
            await sender
        except (ConnectionError, OSError):
            sender.cancel()
        finally:
            writer.close()
