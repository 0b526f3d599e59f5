"""Stamping a request's journey: every hop appends a TraceEvent to the request's
trace list in Redis, inside a pipeline the service sends anyway."""

from __future__ import annotations

from typing import Any

from common.keys import Keys
from common.protocol import TraceEvent, encode, now

# A trace is small; the cap only guards against a runaway list.
TRACE_EVENT_LIMIT = 4096


def stamp(pipe: Any, keys: Keys, request_id: str, hop: str, service: str, ttl: float,
          **detail: str | int | float) -> None:
    """Queue the event on `pipe` (a sync or an asyncio redis pipeline); nothing when TRACE_TTL is 0."""
    if ttl <= 0:
        return
    key = keys.trace(request_id)
    pipe.rpush(key, encode(TraceEvent(hop, service, now(), detail), TRACE_EVENT_LIMIT))
    pipe.expire(key, int(ttl))
