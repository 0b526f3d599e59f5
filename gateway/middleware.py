"""ASGI middleware in front of every route: optional API keys and a body size limit."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ApiError

# The page itself carries no data; the calls it makes need the key the user types in.
OPEN_PATHS = {"/health", "/", "/static/app.js", "/static/style.css"}


async def _reply(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    pass


class Guard:
    """Refuses requests without a valid `Authorization: Bearer <key>` when keys are set (401),
    and bodies over `max_body` bytes (413), before any handler reads them."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body: int) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_keys and scope["path"] not in OPEN_PATHS and not self._authorised(headers):
            return await _reply(send, ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                                               "invalid_api_key"))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return await _reply(send, self._too_large())
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:
                raise BodyTooLarge
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _reply(send, self._too_large())

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and any(hmac.compare_digest(key.strip(), k) for k in self.api_keys)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is over the {self.max_body}-byte limit", "request_too_large")
