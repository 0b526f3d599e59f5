"""HTTP handlers: validate, give the request its request_id, stream or collect its results."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from redis import RedisError

from common.protocol import Done, Error, Submit, Token
from gateway.bus import Bus
from gateway.errors import STATUS_OF_CODE, ApiError
from gateway.schemas import GenerateRequest

log = logging.getLogger("gateway")
router = APIRouter()


def _bus(request: Request) -> Bus:
    return request.app.state.bus


def _sse(data: dict[str, object], event: str | None = None, event_id: int | None = None) -> str:
    head = (f"event: {event}\n" if event else "") + (f"id: {event_id}\n" if event_id is not None else "")
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _seed_events(bus: Bus, submit: Submit) -> AsyncIterator[str]:
    rid = submit.request_id
    async for result in bus.results(submit):
        if isinstance(result, Token):
            yield _sse({"token": result.text, "sequence_id": rid, "index": result.index}, event_id=result.index)
        elif isinstance(result, Done):
            log.info("delivered", extra={"request_id": rid, "finish_reason": result.finish_reason})
            yield _sse({"sequence_id": rid, "finish_reason": result.finish_reason,
                        "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens})
        else:
            yield _sse({"sequence_id": rid, "error": {"message": result.message, "code": result.code}},
                       event="error")


async def _collect(bus: Bus, submit: Submit) -> dict[str, object]:
    parts: list[str] = []
    async for result in bus.results(submit):
        if isinstance(result, Token):
            parts.append(result.text)
        elif isinstance(result, Error):
            raise ApiError(STATUS_OF_CODE.get(result.code, 500), result.message, result.code)
        else:
            return {"sequence_id": submit.request_id, "text": "".join(parts), "finish_reason": result.finish_reason,
                    "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
    raise ApiError(500, "the result stream ended without an answer", "incomplete")


@router.post("/generate_stream", summary="Stream one completion as server-sent events")
async def generate_stream(body: GenerateRequest, request: Request) -> StreamingResponse:
    if body.prompt is None:
        raise ApiError(400, "/generate_stream takes one 'prompt'", "invalid_value", "prompt")
    submit = body.submits()[0]
    log.info("received", extra={"request_id": submit.request_id, "route": "/generate_stream"})
    return StreamingResponse(_seed_events(_bus(request), submit), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": submit.request_id})


@router.post("/generate", summary="Whole completions for one prompt or a list of prompts")
async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
    submits = body.submits()
    for submit in submits:
        log.info("received", extra={"request_id": submit.request_id, "route": "/generate"})
    results = await asyncio.gather(*(_collect(_bus(request), s) for s in submits))
    return JSONResponse(results[0] if body.prompt is not None else {"results": results})


@router.get("/health", summary="Redis reachability and the number of live workers")
async def health(request: Request) -> JSONResponse:
    bus = _bus(request)
    try:
        await bus.redis.ping()
        workers = await bus.live_workers()
    except (RedisError, OSError):
        return JSONResponse({"status": "unavailable", "redis": False, "workers": 0}, status_code=503)
    return JSONResponse({"status": "ok" if workers else "no_workers", "redis": True, "workers": len(workers),
                         "slots": sum(w.slots for w in workers), "running": sum(w.running for w in workers)})
