"""Running a generation for an HTTP handler: admission, the first result before
any header is sent (so queue-full and bad-prompt errors keep their HTTP status),
and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack
from typing import TypeVar

from fastapi import Request

from common.errors import status_of
from common.protocol import Error, Result, Submit
from gateway.bus import Bus, Refused
from gateway.errors import ApiError, ClientGone, retry_headers

T = TypeVar("T")


def api_error(error: Error) -> ApiError:
    return ApiError(status_of(error.code), error.message, error.code, headers=retry_headers(error.code))


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` while watching the connection; raise ClientGone if the client leaves first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    raise ClientGone


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


async def start(bus: Bus, request: Request, submits: list[Submit]) -> tuple[AsyncExitStack, AsyncIterator[
        tuple[int, Result]]]:
    """Admit `submits` and wait for their first result. Returns the open session (close it when
    done; closing early cancels what still runs) and every result, the first included."""
    stack = AsyncExitStack()
    try:
        results = await stack.enter_async_context(bus.session(submits))
        first = await unless_disconnected(request, anext(results))
    except Refused as refused:
        await stack.aclose()
        raise ApiError.of(refused.code, refused.message, refused.param) from None
    except BaseException:
        await stack.aclose()
        raise
    if isinstance(first[1], Error):
        await stack.aclose()
        raise api_error(first[1])
    return stack, _prepend(first, results)


async def gather_results(results: AsyncIterator[tuple[int, Result]], choices: int) -> list[list[Result]]:
    """Every result of every choice, in order; the first error ends it as an ApiError."""
    collected: list[list[Result]] = [[] for _ in range(choices)]
    async for choice, result in results:
        if isinstance(result, Error):
            raise api_error(result)
        collected[choice].append(result)
    return collected


async def collect(bus: Bus, request: Request, submits: list[Submit]) -> list[list[Result]]:
    stack, results = await start(bus, request, submits)
    async with stack:
        return await unless_disconnected(request, gather_results(results, len(submits)))
