"""Streams that outlive their connection: `GET /v1/requests/{request_id}/stream` resumes a stream
on any gateway from the client's Last-Event-ID, in the format of the request that started it, and
`DELETE /v1/requests/{request_id}` cancels one at once (a disconnect leaves it RESUME_GRACE to be
resumed).

A resume subscribes to the live results first, reads the results logs second, and sends what the
client lacks: every result after its position, once, then the live rest. Only the API key that
created a stream may resume or cancel it; any other, an unknown id, an expired one: 404, the same
answer, so that an id's existence is never told."""

from __future__ import annotations

from fastapi import APIRouter, Header, Query, Request, Response

from common.errors import ErrorCode
from common.protocol import Error, StreamMeta
from gateway import metrics
from gateway.errors import ApiError
from gateway.formats import EventResponse, Shape, chunk_events, generate_events
from gateway.sse import format_id, parse_id
from gateway.streams import ResultStream
from gateway.submits import bus_of, tenant_of

router = APIRouter(prefix="/v1/requests")

ANSWER_PREFIXES = ("chatcmpl-", "cmpl-")
MAX_ID = 128


async def _owned(request: Request, request_id: str) -> StreamMeta:
    """The stream `request_id` names (the bare id, or an OpenAI answer's id), if this client may have it."""
    for prefix in ANSWER_PREFIXES:
        request_id = request_id.removeprefix(prefix)
    bus = bus_of(request)
    findable = bus.settings.resumable() and 0 < len(request_id) <= MAX_ID
    meta = await bus.ledger.stream_meta(request_id) if findable else None
    if meta is None or (meta.keyed and meta.tenant != tenant_of(request)):
        raise ApiError.of(ErrorCode.STREAM_NOT_FOUND, f"no stream '{request_id}' to resume (unknown, another key's, "
                          "or older than RESUME_TTL)", "request_id")
    return meta


@router.get("/{request_id}/stream", summary="Resume a stream from its Last-Event-ID, on any gateway",
            responses={200: {"content": {"text/event-stream": {}}}, 204: {"description": "nothing left to send"}})
async def resume(request: Request, request_id: str,
                 last_event_id: str | None = Query(None, max_length=8192, description="The id of the last event "
                                                   "received, for clients that cannot send the header"),
                 last_event_header: str | None = Header(None, alias="Last-Event-ID")) -> Response:
    meta = await _owned(request, request_id)
    # The header wins: an EventSource sends its latest id there, while the URL keeps the one it started from.
    positions = parse_id(last_event_header if last_event_header is not None else last_event_id,
                         len(meta.request_ids))
    if positions is None:
        return Response(status_code=204)  # the client has it all; 204 also stops an EventSource reconnecting
    bus = bus_of(request)
    request.state.request_id = meta.request_ids[0]
    stream = ResultStream(bus, meta.request_ids, meta, positions, stop_on_error=meta.api != "seed")
    try:
        await stream.open()
        await stream.replay()
        if meta.api == "seed" and stream.all_ended and not stream.backlog:
            await stream.let_go()
            return Response(status_code=204)
        await stream.hold()
        await bus.ledger.stamp(stream.pending(), "resumed", last_event_id=format_id(positions))
    except BaseException:
        await stream.let_go()
        raise
    metrics.RESUMED.inc()
    events = generate_events(stream) if meta.api == "seed" else chunk_events(stream, Shape.of(meta), meta)
    return EventResponse(stream, events)


@router.delete("/{request_id}", summary="Cancel a request at once, wherever it is", status_code=204,
               responses={204: {"description": "cancelled (or ended already)"}})
async def cancel(request: Request, request_id: str) -> Response:
    meta = await _owned(request, request_id)
    bus = bus_of(request)
    error = Error(ErrorCode.CANCELLED, "the request was cancelled by its client")
    pending = await bus.ledger.unfinished(meta.request_ids)
    await bus.ledger.cancel(meta.request_ids, meta.tenant, pending, [], error, logged=True)
    return Response(status_code=204)
