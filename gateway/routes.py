"""The seed's routes (`/generate`, `/generate_stream`) and `/health`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from redis import RedisError

from common.errors import ErrorCode
from common.protocol import ChatMessage, Done, Heartbeat, Result, Submit, Token
from gateway.bus import Bus
from gateway.errors import ApiError
from gateway.schemas import GenerateRequest, SamplingFields
from gateway.streams import collect, start

log = logging.getLogger("gateway")
router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def bus_of(request: Request) -> Bus:
    return request.app.state.bus


def sse(data: object, event: str | None = None, event_id: int | None = None) -> bytes:
    """One server-sent event; msgspec's encoder, since this runs once per token of every stream."""
    head = (f"event: {event}\n" if event else "") + (f"id: {event_id}\n" if event_id is not None else "")
    payload = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    return b"%sdata: %s\n\n" % (head.encode(), payload)


async def submits_for(request: Request, body: SamplingFields, prompts: list[str | None], choices: int = 1,
                      messages: list[ChatMessage] | None = None, logprobs: int | None = None) -> list[Submit]:
    """One Submit per prompt and choice, each with its own request_id (choice i samples with seed + i),
    all of one tenant: the digest of the API key that authorised the request (set by the Guard), or
    else the request's first request_id."""
    bus = bus_of(request)
    check_engine_bounds(await bus.live_workers(), body)
    submits = [body.submit(prompt=p, messages=messages, seed_offset=i, logprobs=logprobs,
                           queue_timeout=bus.settings.queue_timeout) for p in prompts for i in range(choices)]
    tenant = getattr(request.state, "tenant", None) or submits[0].request_id
    for submit in submits:
        submit.tenant = tenant
        log.info("received", extra={"request_id": submit.request_id})
    request.state.request_id = submits[0].request_id
    return submits


def check_engine_bounds(workers: list[Heartbeat], body: SamplingFields) -> None:
    """The bounds only the live workers know: their context and their vocabulary (a worker that does
    not tell its vocabulary clamps top_k itself)."""
    contexts = [w.context for w in workers]
    if body.max_tokens is not None and contexts and body.max_tokens >= min(contexts):
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"max_tokens is {body.max_tokens}; the model's context is "
                          f"{min(contexts)} tokens, prompt and completion together", "max_tokens")
    vocabularies = [w.vocab for w in workers if w.vocab > 0]
    if vocabularies and body.top_k > min(vocabularies):
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"top_k is {body.top_k}; the model's vocabulary has "
                          f"{min(vocabularies)} tokens", "top_k")


def done_fields(request_id: str, done: Done) -> dict[str, object]:
    return {"sequence_id": request_id, "finish_reason": done.finish_reason, "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens}


async def _seed_events(stack: AsyncExitStack, submit: Submit, results: AsyncIterator[tuple[int, Result]]
                       ) -> AsyncIterator[bytes]:
    rid = submit.request_id
    async with stack:
        async for _, result in results:
            if isinstance(result, Token):
                yield sse({"token": result.text, "sequence_id": rid, "index": result.index}, event_id=result.index)
            elif isinstance(result, Done):
                log.info("delivered", extra={"request_id": rid, "finish_reason": result.finish_reason})
                yield sse(done_fields(rid, result))
            else:
                yield sse({"sequence_id": rid, "error": {"message": result.message, "code": result.code}},
                          event="error")


@router.post("/generate_stream", summary="Stream one completion as server-sent events")
async def generate_stream(body: GenerateRequest, request: Request) -> StreamingResponse:
    if body.prompt is None:
        raise ApiError.of(ErrorCode.INVALID_VALUE, "/generate_stream takes one 'prompt'", "prompt")
    bus = bus_of(request)
    submits = await submits_for(request, body, body.prompt_list())
    stack, results = await start(bus, request, submits)
    return StreamingResponse(_seed_events(stack, submits[0], results), media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Request-Id": submits[0].request_id})


@router.post("/generate", summary="Whole completions for one prompt or a list of prompts")
async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
    bus = bus_of(request)
    submits = await submits_for(request, body, body.prompt_list())
    collected = await collect(bus, request, submits)
    answers = []
    for submit, results in zip(submits, collected, strict=True):
        text = "".join(r.text for r in results if isinstance(r, Token))
        answers.append({**done_fields(submit.request_id, results[-1]), "text": text})
    return JSONResponse(answers[0] if body.prompt is not None else {"results": answers})


@router.get("/health", summary="Redis reachability and the number of live workers")
async def health(request: Request) -> JSONResponse:
    bus = bus_of(request)
    try:
        await bus.redis.ping()
        workers = await bus.live_workers()
    except (RedisError, OSError):
        return JSONResponse({"status": "unavailable", "redis": False, "workers": 0}, status_code=503)
    return JSONResponse({"status": "ok" if workers else "no_workers", "redis": True, "workers": len(workers),
                         "slots": sum(w.slots for w in workers), "running": sum(w.running for w in workers)})
