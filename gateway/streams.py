"""The results of one HTTP request, as its client is to receive them: `ResultStream`, one object
per request (its choices), async-iterable and closeable. It owns its subscription, its position in
every choice (gateway/positions.py: nothing reaches the client twice, whether it comes from the
results log, gateway/replay.py, a repeat after a migration or the live channel), its metrics, and
how it ends: delivered, left to its lease when the client goes away (to be resumed on any gateway
within RESUME_GRACE), or cancelled. The /generate routes and the OpenAI routes format its results
(gateway/formats.py); a resume (gateway/resume.py) opens the same object at the client's Last-Event-ID.

`start` admits a request and waits for its first result before any header is sent, so that a
request refused by the queue or the worker keeps its HTTP status; `gather` collects whole answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import anyio
from fastapi import Request

from common.errors import ErrorCode
from common.protocol import Error, Result, StreamMeta, Submit, Token
from common.runtime import REDIS_ERRORS
from gateway import metrics
from gateway.admission import Refused
from gateway.bus import Bus
from gateway.errors import ApiError, ClientGone
from gateway.mailbox import Mailbox
from gateway.positions import Meter, Positions
from gateway.replay import logged
from gateway.results import BROKEN

log = logging.getLogger("gateway")
T = TypeVar("T")

# The delay an EventSource waits before it reconnects, at most (and half of RESUME_GRACE at most).
RETRY_MS = 1000



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


class ResultStream:
    """One HTTP request's choices as its client reads them, from `positions` (a resume's Last-Event-ID) on."""

    def __init__(self, bus: Bus, request_ids: list[str], meta: StreamMeta | None = None,
                 positions: list[int] | None = None, stop_on_error: bool = False, tenant: str = "",
                 background: bool = False) -> None:
        self.bus = bus
        self.request_ids = request_ids
        # A batch job's line, read by the gateway itself: no client's latency, nor its key's quota.
        self.background = background
        # A stream with a results log may be resumed; without one (whole answers) it is cancelled when left.
        self.meta = meta if bus.settings.resumable() else None
        self.tenant = meta.tenant if meta else tenant
        choices = len(request_ids)
        self.resumed = positions is not None
        self.positions = Positions(choices, positions)
        self.meter = Meter(bus.throughput, choices, timed=not self.resumed and not background)
        # The tokens of each choice the client had before this stream began (a resume): formats that read the
        # text as a whole (tool calls) pick up from them.
        self.earlier: list[list[Token]] = [[] for _ in range(choices)]
        # An OpenAI stream ends with its first error, which a resumed client may have had already.
        self.stop_on_error = stop_on_error
        # Results accepted but not yet taken (those of the log, and the first one held back by `first`), each
        # with the id of its event: the positions right after it.
        self.backlog: deque[tuple[int, Result, str]] = deque()
        self.current_id = self.positions.event_id()
        self.mailbox: Mailbox | None = None
        self._subscription: AbstractAsyncContextManager[Mailbox] | None = None
        self.holding = False  # this gateway extends the stream's lease while it is read here
        self.closed = False
        self.sent_all = False  # set by the formatter once its last event is on its way
        self.retry_ms: int | None = None
        if self.meta is not None and bus.leases.enabled:
            self.retry_ms = max(min(RETRY_MS, bus.leases.grace_ms // 2), 1)

    @property
    def head(self) -> str:
        return self.request_ids[0]

    @property
    def all_ended(self) -> bool:
        return self.positions.all_ended

    @property
    def errors(self) -> dict[int, Error]:
        """The choices that ended in an error, by index."""
        return self.positions.errors

    @property
    def over(self) -> bool:
        """Nothing more to take: every choice has ended, or (OpenAI) one has failed."""
        return self.all_ended or (self.stop_on_error and bool(self.errors))

    def preamble(self) -> bytes:
        """What goes before the next event: once, the delay an EventSource is to wait before it reconnects
        (`retry:`), when the stream may be resumed; carried by a real event, since an event of its own,
        without data, would reach some clients as an empty one."""
        if self.retry_ms is None:
            return b""
        retry, self.retry_ms = self.retry_ms, None
        return b"retry: %d\n" % retry

    # Opening.

    async def open(self) -> None:
        """Subscribe to every choice's channel; returns once Redis has confirmed it."""
        subscription = self.bus.router.open(self.request_ids, self._too_slow)
        self.mailbox = await subscription.__aenter__()
        self._subscription = subscription
        metrics.ACTIVE.inc()

    async def admit(self, submits: list[Submit]) -> None:
        await self.bus.admission.admit(submits, self.meta)
        if self.meta is not None and self.bus.leases.enabled:
            self.bus.leases.hold(self.request_ids)
            self.holding = True

    async def replay(self) -> None:
        """Take what the logs hold past the client's positions (subscribed first: what the logs miss arrives
        live). Raises ApiError 410 when a log no longer reaches back to where the client stands."""
        for choice, results in enumerate(await logged(self.bus.ledger, self.request_ids, self.positions.next)):
            earlier = self.earlier[choice]
            for result in results:
                if self._accept(choice, result):
                    self.backlog.append((choice, result, self.positions.event_id()))
                elif isinstance(result, Token) and result.index == len(earlier) < self.positions.next[choice]:
                    earlier.append(result)
        if self.stop_on_error and self.positions.stale_error:
            self.backlog.clear()

    async def hold(self) -> None:
        """A resumed client reads the stream here: extend its lease now (if it has not lapsed) and from now on."""
        if self.meta is not None and self.bus.leases.enabled and not self.all_ended:
            await self.bus.leases.extend([self.head], self.request_ids)
            self.bus.leases.hold(self.request_ids)
            self.holding = True

    async def first(self) -> tuple[int, Result]:
        """The first result the client is to get, kept for the iteration."""
        choice, result = await anext(self)
        self.backlog.appendleft((choice, result, self.current_id))
        return choice, result

    # Iterating.

    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> tuple[int, Result]:
        while True:
            if self.backlog:
                choice, result, self.current_id = self.backlog.popleft()
                return choice, result
            if self.over or self.mailbox is None:
                raise StopAsyncIteration
            choice, result = await self.mailbox.get()
            if self._accept(choice, result):
                self.current_id = self.positions.event_id()
                return choice, result

    def _accept(self, choice: int, result: Result) -> bool:
        """Whether `result` is new to the client (its position moves either way); a new one is metered."""
        fresh = self.positions.accept(choice, result)
        if fresh:
            self.meter.taken(choice, result)
        return fresh

    # Ending.

    async def close(self, client_left: bool | None = None) -> None:
        """End the stream, once. Every choice ended: delivered. The formatter stopped early (an error): the
        rest is cancelled. The client left (by default, when the formatter did not send its last event): a
        stream that may be resumed is left to its lease; any other is cancelled."""
        if client_left is None:
            client_left = not self.sent_all
        broken = [choice for choice, error in self.errors.items() if any(error is b for b in BROKEN)]
        if self.all_ended and broken:
            await self._end(self._settle_broken(broken))
        elif self.all_ended:
            await self._end(self.bus.ledger.finish(self.request_ids, self.tenant, self.delivered(), not self.resumed))
        elif client_left and self.meta is not None and self.bus.leases.enabled:
            await self._end(self.bus.ledger.detach(self.request_ids, self.pending(), self.delivered()))
        else:
            why = "its client left" if client_left else "the stream ended early (another choice failed)"
            await self.cancel(Error(ErrorCode.CANCELLED, f"the request was cancelled: {why}"))

    async def _settle_broken(self, choices: list[int]) -> None:
        """Choices that ended because this gateway lost its connection to Redis (or, in a cluster, a node):
        their requests may still run, and their logs do not say they ended, so a client resuming them (an
        EventSource does, after an error) would wait for ever. Cancelled, with the error in their logs, as
        far as Redis can be reached again."""
        rids = [self.request_ids[choice] for choice in choices]
        if self.meta is not None:
            await self.bus.ledger.record(rids, self.errors[choices[0]])
        await self.bus.ledger.cancel(self.request_ids, self.tenant, rids, self.delivered(), None, logged=False)

    async def cancel(self, error: Error | None = None) -> None:
        """Cancel whatever has not ended now, with `error` in its logs."""
        await self._end(self.bus.ledger.cancel(self.request_ids, self.tenant, self.pending(), self.delivered(), error,
                                        logged=self.meta is not None))

    async def let_go(self) -> None:
        """Stop reading, and leave the requests as they are (a resume that could not start)."""
        await self._end(None)

    async def _end(self, ending: Awaitable[None] | None) -> None:
        if self.closed:
            if ending is not None:
                ending.close()  # a coroutine never awaited
            return
        self.closed = True
        # Shielded: a client that leaves cancels the task that runs this, and the ending must still happen.
        with anyio.CancelScope(shield=True):
            if self.holding:
                self.bus.leases.let_go(self.head)
            if self._subscription is not None:
                metrics.ACTIVE.dec()
                with contextlib.suppress(*REDIS_ERRORS, OSError):
                    await self._subscription.__aexit__(None, None, None)
            if ending is not None:
                with contextlib.suppress(*REDIS_ERRORS, OSError):
                    await ending
            if not self.background:  # a batch job's lines count against no key's quota
                with contextlib.suppress(*REDIS_ERRORS, OSError):
                    await self.bus.ledger.spend(self.tenant, self.head, self.positions.used(), self.meta is not None)

    def pending(self) -> list[str]:
        return [rid for rid, ended in zip(self.request_ids, self.positions.ended, strict=True) if not ended]

    def delivered(self) -> list[str]:
        return [rid for rid, done in zip(self.request_ids, self.positions.delivered_end, strict=True) if done]

    def _too_slow(self) -> None:
        """The client stopped reading (its mailbox overflowed): cancel its requests now, though its handler is
        stuck in `send`; the mailbox holds the client_too_slow error it gets if it ever reads again."""
        metrics.SLOW_CLIENTS.inc()
        error = Error(ErrorCode.CLIENT_TOO_SLOW, f"the client did not read its stream: over "
                      f"{self.bus.settings.client_buffer_bytes} bytes of results waited for it, so the request "
                      "was cancelled")
        self.bus.soon(self.cancel(error))


async def start(bus: Bus, request: Request, submits: list[Submit], meta: StreamMeta | None = None,
                stop_on_error: bool = False) -> ResultStream:
    """Subscribe, admit `submits` and wait for their first result. Returns the open stream; a failure or a
    client that leaves first cancels it (a client that never saw a header cannot resume)."""
    stream = ResultStream(bus, [s.request_id for s in submits], meta, stop_on_error=stop_on_error,
                          tenant=submits[0].tenant)
    try:
        await stream.open()
        await stream.admit(submits)
        _, first = await unless_disconnected(request, stream.first())
    except Refused as refused:
        await stream.let_go()
        error = ApiError.of(refused.code, refused.message, refused.param)
        if refused.retry_after is not None:
            error.headers = {"Retry-After": str(refused.retry_after)}
        raise error from None
    except BaseException:
        await stream.cancel(Error(ErrorCode.CANCELLED, "the request was cancelled: its client left before its "
                                  "first result"))
        raise
    if isinstance(first, Error):
        await stream.cancel(Error(ErrorCode.CANCELLED, "the request was cancelled: another choice failed"))
        raise ApiError.of_result(first)
    return stream


async def gather(request: Request, stream: ResultStream) -> list[list[Result]]:
    """Every result of every choice of an open stream, in order, then the stream closed; the first error ends it
    as an ApiError. A client that leaves first leaves a stream that may be resumed to its lease."""
    try:
        return await unless_disconnected(request, _gather(stream, len(stream.request_ids)))
    except ClientGone:
        await stream.close(client_left=True)
        raise
    finally:
        await stream.close(client_left=False)


async def _gather(results: AsyncIterator[tuple[int, Result]], choices: int) -> list[list[Result]]:
    collected: list[list[Result]] = [[] for _ in range(choices)]
    async for choice, result in results:
        if isinstance(result, Error):
            raise ApiError.of_result(result)
        collected[choice].append(result)
    return collected
