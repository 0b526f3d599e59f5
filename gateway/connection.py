"""Limits on an HTTP connection before a request reaches the app: the size of a request's
head (request line and headers, MAX_HEADER_BYTES) and the time it may take to arrive
(HEADER_TIMEOUT). uvicorn's httptools protocol has neither, and httptools (as uvicorn does
the URL) grows a header that arrives in pieces by concatenation: one connection sending an
endless header would cost the event loop, and so every other stream, time that grows with
the square of its length. The app's own limits on the body are in gateway/middleware.py.

A client that stops reading should cost little before the gateway notices (its handler
blocks on a full transport) and cancels it past CLIENT_BUFFER_BYTES: so each connection
bounds the bytes the kernel holds unsent for it (TCP_NOTSENT_LOWAT; else the socket's send
buffer grows to its autotuned maximum), and its transport's write buffer is small, since
uvloop keeps each buffered write (one per token of a stream) with a few hundred bytes of
bookkeeping besides."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from common.errors import ErrorCode
from gateway.errors import ApiError

log = logging.getLogger("gateway")

UNSENT_BYTES = 64 << 10
WRITE_BUFFER_BYTES = 16 << 10


@dataclass(frozen=True)
class HeadLimits:
    # 0: no limit, for either.
    max_bytes: int
    # Seconds from a request's first byte (or the connection's opening) to the end of its headers.
    timeout: float

    def over(self, size: int) -> bool:
        return bool(self.max_bytes) and size > self.max_bytes


class HeadRefused(Exception):
    """Raised in a parser callback, to stop parsing a request that has been answered."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` on each request's head: over the size, 431
    `headers_too_large`; over the time, 408 `request_timeout`; either way the connection closes."""

    limits = HeadLimits(max_bytes=16384, timeout=10.0)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.reading_head = True
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False
        super().connection_made(transport)
        self._start_timer()  # a connection that never sends a byte is not kept either
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            with contextlib.suppress(OSError):  # not a TCP socket (a Unix one), or not Linux
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_BYTES)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.reading_head:
            # Counted before parsing; a chunk that also carries body bytes is judged exactly below.
            self.head_bytes += len(data)
            self._start_timer()
        super().data_received(data)
        if self.reading_head and self.limits.over(self.head_bytes) and not self.refused:
            self._refuse(ErrorCode.HEADERS_TOO_LARGE, f"the request's headers are over {self.limits.max_bytes} "
                         "bytes (MAX_HEADER_BYTES)", self.head_bytes)

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        self.reading_head, self.head_bytes = False, 0
        self._stop_timer()
        if self.limits.over(size):
            self._refuse(ErrorCode.HEADERS_TOO_LARGE, f"the request's headers are {size} bytes, over "
                         f"{self.limits.max_bytes} (MAX_HEADER_BYTES)", size)
            raise HeadRefused
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.reading_head = True  # the next byte starts the next request's head

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP, in the API's error shape. The parser reports
        HeadRefused as such bytes too; that request has had its answer."""
        if not self.refused:
            self._refuse(ErrorCode.INVALID_VALUE, f"the request is not valid HTTP: {msg}", self.head_bytes)

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.reading_head and not self.refused:
            self._refuse(ErrorCode.REQUEST_TIMEOUT, f"the request's headers did not arrive within "
                         f"{self.limits.timeout:g} s (HEADER_TIMEOUT)", self.head_bytes)

    def _start_timer(self) -> None:
        if self.head_timer is None and self.limits.timeout:
            self.head_timer = self.loop.call_later(self.limits.timeout, self._head_timed_out)

    def _stop_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _refuse(self, code: ErrorCode, message: str, head_bytes: int) -> None:
        """Answer (unless a response of this connection is still being written) and close."""
        self.refused = True
        self._stop_timer()
        log.warning("refused a request's head", extra={"code": str(code), "client": str(self.client),
                                                       "head_bytes": head_bytes, "reason": message})
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps(ApiError.of(code, message).body()).encode()
            head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            self.transport.write(STATUS_LINE[code.status] + head + body)
        self.transport.close()


def limited_protocol(limits: HeadLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class for `uvicorn.run(http=...)`, which builds each connection's instance itself."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
