"""A stream's results logs read back for a reader that starts where its client stands (a resume, an idempotent
retry): each choice's logged results decoded, and refused where the log cannot replay that position exactly (410:
trimmed past it, or gone; 400: a position the stream never reached). The logs are the ledger's (gateway/ledger.py)."""

from __future__ import annotations

import logging

from common.errors import ErrorCode
from common.protocol import Done, ProtocolError, Result, Token, decode
from gateway.errors import ApiError
from gateway.ledger import Ledger

log = logging.getLogger("gateway")


async def logged(ledger: Ledger, request_ids: list[str], next_positions: list[int]) -> list[list[Result]]:
    """Each choice's logged results, oldest first, for a client that needs `next_positions` next."""
    replayed = []
    for choice, entries in enumerate(await ledger.read_logs(request_ids)):
        results = [] if entries is None else _decoded(request_ids[choice], entries, ledger.limit)
        wanted = next_positions[choice]
        # A log that is gone (its choice ended over RESUME_TTL ago) cannot be replayed exactly either.
        if entries is None or wanted < _first_kept(results):
            raise ApiError.of(ErrorCode.STREAM_TRUNCATED, f"choice {choice} of the stream no longer keeps the "
                              f"results after position {wanted - 1} (RESUME_LOG_BYTES bounds what a stream keeps)",
                              "Last-Event-ID")
        # A result is logged in the same step it is published, so no client can stand past the log's reach.
        if wanted - 1 > _reach(results):
            raise ApiError.of(ErrorCode.INVALID_VALUE, f"Last-Event-ID must be the id of an event of this stream: "
                              f"choice {choice} has not reached position {wanted - 1}", "Last-Event-ID")
        replayed.append(results)
    return replayed


def _decoded(request_id: str, entries: list[bytes], limit: int) -> list[Result]:
    results = []
    for entry in entries:
        try:
            results.append(decode(entry, Result, limit))
        except ProtocolError as exc:
            log.error("dropped a malformed logged result", extra={"request_id": request_id, "error": str(exc)})
    return results


def _first_kept(results: list[Result]) -> int:
    """The first position a trimmed log still holds."""
    for result in results:
        if isinstance(result, Token):
            return result.index
        if isinstance(result, Done):
            return result.completion_tokens
    return 0


def _reach(results: list[Result]) -> int:
    """The furthest position a log shows: its last token's, or its end's (one past its last token)."""
    last = max((r.index for r in results if isinstance(r, Token)), default=-1)
    end = next((r for r in results if not isinstance(r, Token)), None)
    if end is None:
        return last
    return max(last + 1, end.completion_tokens if isinstance(end, Done) else 0)
