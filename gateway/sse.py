"""Server-sent events: the encoding of one event, the response headers, and the event ids that
let a client resume a stream exactly.

An event's id is where the client stands in every choice after that event: for each choice, the
position of the last thing delivered (a token's index; its end, a Done or an Error, counts as one
past its last token), -1 before anything; one number for n = 1 (`id: 12`, the token's index, as
/generate_stream always had), dot-separated for more (`id: 12.7.-1`). Stateless and exact: sent
back as Last-Event-ID, it says which results the client still needs. The last event of an OpenAI
stream (`data: [DONE]`) has the id `done`: the client has everything."""

from __future__ import annotations

import msgspec

from common.errors import ErrorCode
from gateway.errors import ApiError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"
COMPLETE = "done"
# Longest Last-Event-ID read: 16 choices x 11 digits is far less; a long one is refused, never parsed.
MAX_EVENT_ID = 8192


def sse(data: object, event: str | None = None, event_id: str | None = None) -> bytes:
    """One server-sent event; msgspec's encoder, since this runs once per token of every stream."""
    head = (f"event: {event}\n" if event else "") + (f"id: {event_id}\n" if event_id is not None else "")
    payload = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    return b"%sdata: %s\n\n" % (head.encode(), payload)


def format_id(positions: list[int]) -> str:
    return ".".join(map(str, positions))


def parse_id(value: str | None, choices: int) -> list[int] | None:
    """Positions from a Last-Event-ID (all -1 without one); None for `done`. Anything else is a 400."""
    if value is None or not value.strip():
        return [-1] * choices
    value = value.strip()
    if value == COMPLETE:
        return None
    parts = value.split(".") if len(value) <= MAX_EVENT_ID else []
    try:
        positions = [int(part) for part in parts]
    except ValueError:
        positions = []
    if len(positions) != choices or any(p < -1 for p in positions):
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"Last-Event-ID must be the id of an event of this stream: "
                          f"{choices} integer(s) of at least -1, dot-separated, or '{COMPLETE}'", "Last-Event-ID")
    return positions
