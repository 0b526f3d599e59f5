"""ASGI middleware in front of every route: optional API keys, and the body's size and
time limits. The Guard reads the whole body before any handler runs (every route takes
a small JSON body or none), so that a body over the limit is 413 whether or not it
declared its length, and a body that never ends is 408, whichever route it is for."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import ErrorCode
from common.tracing import Tracing
from gateway.errors import ApiError
from gateway.page import ASSETS

# The page itself carries no data; the calls it makes need the key the user types in.
OPEN_PATHS = {"/health", "/", *(f"/static/{name}" for name in ASSETS)}
TENANT_HEX = 16


def tenant_of(key: bytes) -> str:
    """Whom a key's requests belong to on the bus: a digest, never the key itself."""
    return hashlib.sha256(key).hexdigest()[:TENANT_HEX]


async def _reply(send: Send, error: ApiError, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    headers += [(name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body read already, then whatever comes next (the disconnect)."""
    first: list[bytes] = [body]

    async def replayed() -> Message:
        if first:
            return {"type": "http.request", "body": first.pop(), "more_body": False}
        return await receive()

    return replayed


class Guard:
    """Refuses requests without a valid `Authorization: Bearer <key>` when keys are set (401), bodies
    over `max_body` bytes (413) and bodies that take over `body_timeout` seconds (408), before any
    handler runs. The digest of the key that authorised a request is left in scope["state"]["tenant"]. A path
    in `uploads` (a file upload) has its own limit and setting, named in its 413."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body: int, body_timeout: float = 0.0,
                 uploads: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.uploads = uploads or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_keys and scope["path"] not in OPEN_PATHS:
            key = self._key_of(headers)
            if key is None:
                return await _reply(send, ApiError.of(ErrorCode.INVALID_API_KEY, "a valid API key is required: "
                                                      "Authorization: Bearer <key>"))
            scope.setdefault("state", {})["tenant"] = tenant_of(key)
        limit = self.uploads.get(scope["path"], (self.max_body, "MAX_MESSAGE_BYTES"))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit[0]:
            return await _reply(send, self._too_large(limit))
        try:
            body = await self._read_body(receive, limit)
        except ApiError as error:
            return await _reply(send, error, close=error.status == ErrorCode.REQUEST_TIMEOUT.status)
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive, limit: tuple[int, str]) -> bytes | None:
        """The whole body, or None if the client left while sending it."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout or None):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit[0]:
                        raise self._too_large(limit)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise ApiError.of(ErrorCode.REQUEST_TIMEOUT, f"the request body did not arrive within "
                              f"{self.body_timeout:g} s (BODY_TIMEOUT)") from None

    def _key_of(self, headers: dict[bytes, bytes]) -> bytes | None:
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        key = key.strip()
        # Every key is compared, so that the time taken does not tell which one nearly matched.
        matches = [k for k in self.api_keys if hmac.compare_digest(key, k)]
        return matches[0] if matches else None

    @staticmethod
    def _too_large(limit: tuple[int, str]) -> ApiError:
        return ApiError.of(ErrorCode.REQUEST_TOO_LARGE, f"the request body is over the {limit[0]}-byte limit "
                           f"({limit[1]})")


class Traced:
    """The gateway's span of each request that generates or resumes (POST, and a stream's resume), a child of
    the client's `traceparent` when it sends one; the response carries the span's own `traceparent`, and the
    Submits carry it on (gateway/submits.py), so the scheduler's and the worker's spans join the same trace."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tracing.enabled or not _traced(scope):
            return await self.app(scope, receive, send)
        parent = dict(scope["headers"]).get(b"traceparent", b"").decode("latin-1")
        span = self.tracing.start(f"{scope['method']} {scope['path']}", parent, server=True, **{
            "http.request.method": scope["method"], "url.path": scope["path"]})
        state = scope.setdefault("state", {})
        state["span"] = span
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"traceparent", Tracing.header(span).encode())]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.tracing.end(span, error=f"HTTP {status}" if status >= 500 else "", **{
                "http.response.status_code": status, "llmserve.request_id": state.get("request_id", "")})


def _traced(scope: Scope) -> bool:
    return scope["method"] == "POST" or scope["path"].startswith("/v1/requests/")
