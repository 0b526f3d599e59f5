"""Retries that do not run twice: `Idempotency-Key` on the generation routes, on POST /v1/batches and POST /v1/files.
The first request with a key keeps what it makes (its request_id, batch id or file id) under the key (per API key,
with a digest of its route and body) for RESUME_TTL; a retry with the same key and body follows the first request's
stream from its start, on any gateway (the resume machinery), or gets the same whole answer, job or file. The same
key with another body is a 409 naming the header. A first request that fails before it runs, or was cancelled (its
client left and nobody retried within RESUME_GRACE), leaves the key to the next try."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from common import scripts
from common.errors import ErrorCode
from common.protocol import StreamMeta, Submit
from gateway.errors import ApiError
from gateway.streams import ResultStream
from gateway.submits import bus_of, tenant_of

HEADER = "Idempotency-Key"
MAX_KEY = 255
# How long a retry waits for the first request's stream to be admitted, or its job or file stored (they are, right
# after its claim).
WAIT_FOR_FIRST_S = 5.0
POLL_S = 0.05
T = TypeVar("T")


@dataclass
class Claim:
    """This request is the first with its key: it runs, and gives the key back if it cannot."""

    key: str
    value: str


@dataclass
class Held:
    """The key names what an earlier request with the same body made (`ident`), under `held`."""

    ident: str
    held: Claim


@dataclass
class Retry:
    """A retry of an earlier request: its stream, to follow from its start, and the claim that names it."""

    meta: StreamMeta
    held: Claim


def requested_key(request: Request) -> str | None:
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    if not 0 < len(raw) <= MAX_KEY or not raw.isascii() or not raw.isprintable():
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"the {HEADER} header must be 1 to {MAX_KEY} printable ASCII "
                          "characters", HEADER)
    return raw


async def attach_or_claim(request: Request, submits: list[Submit]) -> tuple[Claim | None, ResultStream | None]:
    """(claim, None): `submits` are the first with the request's key (`release` it if they cannot run); (None,
    stream): a retry, the earlier request's stream from its start; (None, None): no key, nothing kept."""
    for _ in range(3):  # an earlier request found cancelled gives its key back, and this one claims it
        outcome = await claim(request, submits)
        if not isinstance(outcome, Retry):
            return outcome, None
        stream = await follow(request, outcome)
        if stream is not None:
            return None, stream
        await release(request, outcome.held)
    raise ApiError.of(ErrorCode.IDEMPOTENCY_CONFLICT, f"the request with this {HEADER} is being retried elsewhere; "
                      "retry later", HEADER)


async def claim(request: Request, submits: list[Submit]) -> Claim | Retry | None:
    """Claim the request's Idempotency-Key for `submits`, or find the request that has it. None: no key, or streams
    are not kept (RESUME_TTL=0), so nothing could be replayed: the request runs as any other."""
    for _ in range(2):  # a first request whose gateway died before admitting it leaves the key to a second try
        outcome = await hold(request, submits[0].request_id)
        if not isinstance(outcome, Held):
            return outcome
        meta = await _first(bus_of(request).ledger.stream_meta, outcome.ident)
        if meta is not None:
            return Retry(meta, outcome.held)
        await release(request, outcome.held)  # its gateway died before admitting it: nothing to follow
    raise ApiError.of(ErrorCode.IDEMPOTENCY_CONFLICT, f"the request with this {HEADER} is still starting; retry "
                      "later", HEADER)


async def hold(request: Request, ident: str, digest: str | None = None) -> Claim | Held | None:
    """Keep `ident` under the request's Idempotency-Key, or find what the key already names for the same body
    (`digest`, by default one of the route and the raw body). None: no key, or RESUME_TTL=0 (nothing kept)."""
    key = requested_key(request)
    bus = bus_of(request)
    if key is None or not bus.settings.resumable():
        return None
    body = digest or hashlib.sha256(request.url.path.encode() + b"\0" + await request.body()).hexdigest()
    redis_key = bus.keys.idempotency(tenant_of(request) or "", hashlib.sha256(key.encode()).hexdigest())
    value = f"{body} {ident}"
    ttl_ms = int(bus.settings.resume_ttl * 1000)
    for _ in range(2):  # a claim released between our SET and GET is taken on the second try
        if await bus.redis.set(redis_key, value, nx=True, px=ttl_ms):
            return Claim(redis_key, value)
        held = await bus.redis.get(redis_key)
        if held is None:
            continue
        held = held.decode() if isinstance(held, bytes) else held
        held_body, _, head = held.partition(" ")
        if held_body != body:
            raise ApiError.of(ErrorCode.IDEMPOTENCY_CONFLICT, f"the {HEADER} was used with another body (or route) "
                              "within RESUME_TTL; use a new key for a new request", HEADER)
        return Held(head, Claim(redis_key, held))
    raise ApiError.of(ErrorCode.IDEMPOTENCY_CONFLICT, f"the request with this {HEADER} is still starting; retry "
                      "later", HEADER)


async def made_or_claim(request: Request, ident: str, find: Callable[[str], Awaitable[T | None]],
                        digest: str | None = None) -> tuple[Claim | None, T | None]:
    """For a route that makes a stored thing (a batch job, a file): (claim, None): this request is the first with
    its key, and makes it under `ident` (`release` the claim if it cannot); (None, made): a retry, what the first
    made (`find` reads it by its id); (None, None): no key, nothing kept."""
    for _ in range(2):  # a first request that died before it made anything leaves the key to a second try
        outcome = await hold(request, ident, digest)
        if not isinstance(outcome, Held):
            return outcome, None
        made = await _first(find, outcome.ident)
        if made is not None:
            return None, made
        await release(request, outcome.held)
    raise ApiError.of(ErrorCode.IDEMPOTENCY_CONFLICT, f"the request with this {HEADER} is still being made; retry "
                      "later", HEADER)


async def started(request: Request, claimed: Claim | None, starting: Awaitable[ResultStream]) -> ResultStream:
    """The first request's stream as it starts; a start that fails (refused, its first result an error, its client
    gone) gives the key back, so that a retry runs it anew."""
    try:
        return await starting
    except BaseException:
        if claimed is not None:
            await release(request, claimed)
        raise


async def _first(find: Callable[[str], Awaitable[T | None]], ident: str) -> T | None:
    """What the first request made (its stream admitted, its job or file stored) once it is there; None where it
    never was within WAIT_FOR_FIRST_S (its gateway died first, or it failed and is giving the key back)."""
    deadline = asyncio.get_running_loop().time() + WAIT_FOR_FIRST_S
    while True:
        made = await find(ident)
        if made is not None or asyncio.get_running_loop().time() > deadline:
            return made
        await asyncio.sleep(POLL_S)


async def release(request: Request, held: Claim) -> bool:
    """Give the key back (the request it names will not run, or was cancelled); whether it was still `held`."""
    return bool(await bus_of(request).redis.eval(scripts.RELEASE_CLAIM, 1, held.key, held.value))


async def follow(request: Request, retry: Retry) -> ResultStream | None:
    """The first request's stream from its start, replayed and held as a resume is; None where it was cancelled."""
    bus = bus_of(request)
    meta = retry.meta
    stream = ResultStream(bus, meta.request_ids, meta, [-1] * len(meta.request_ids),
                          stop_on_error=meta.api != "seed")
    try:
        await stream.open()
        await stream.replay()
        if any(error.code == ErrorCode.CANCELLED for error in stream.errors.values()):
            await stream.let_go()
            return None
        await stream.hold()
    except BaseException:
        await stream.let_go()
        raise
    request.state.request_id = meta.request_ids[0]
    return stream
