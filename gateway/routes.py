"""The /generate routes (`/generate`, `/generate_stream`: the native API, older than the OpenAI one) and `/health`."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from common.errors import ErrorCode
from common.protocol import Token
from common.runtime import REDIS_ERRORS
from gateway import idempotency
from gateway.errors import ApiError
from gateway.formats import EventResponse, done_fields, generate_events
from gateway.schemas import GenerateRequest
from gateway.streams import gather, start
from gateway.submits import bus_of, serving, stream_meta, submits_for

router = APIRouter()


@router.post("/generate_stream", summary="Stream one completion as server-sent events")
async def generate_stream(body: GenerateRequest, request: Request) -> EventResponse:
    if body.prompt is None:
        raise ApiError.of(ErrorCode.INVALID_VALUE, "/generate_stream takes one 'prompt'", "prompt")
    submits = await submits_for(request, body, body.prompt_list())
    claimed, stream = await idempotency.attach_or_claim(request, submits)
    if stream is None:
        stream = await idempotency.started(request, claimed, start(bus_of(request), request, submits,
                                                                   stream_meta(request, submits, "seed")))
    return EventResponse(stream, generate_events(stream))


@router.post("/generate", summary="Whole completions for one prompt or a list of prompts")
async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
    submits = await submits_for(request, body, body.prompt_list())
    claimed, stream = await idempotency.attach_or_claim(request, submits)
    if stream is None:  # a whole answer keeps a results log only where a retry may ask for it again
        meta = stream_meta(request, submits, "seed") if claimed else None
        stream = await idempotency.started(request, claimed, start(bus_of(request), request, submits, meta))
    collected = await gather(request, stream)
    answers = []
    for request_id, results in zip(stream.request_ids, collected, strict=True):
        text = "".join(r.text for r in results if isinstance(r, Token))
        answers.append({**done_fields(request_id, results[-1]), "text": text})
    return JSONResponse(answers[0] if body.prompt is not None else {"results": answers})


@router.get("/health", summary="Redis reachability and the number of live workers (of one model, with ?model=)")
async def health(request: Request, model: str | None = Query(None, max_length=256, description=(
        "Only this model's workers, and its requests waiting in the scheduler's queue: what an autoscaler of "
        "that model's workers reads"))) -> JSONResponse:
    bus = bus_of(request)
    try:
        await bus.ping()
        workers = await bus.view.live_workers()
        load = await bus.view.model_load(model) if model is not None else None
    except (*REDIS_ERRORS, OSError):
        return JSONResponse({"status": "unavailable", "redis": False, "workers": 0}, status_code=503)
    if model is not None:
        workers = serving(workers, model)
    answer = {"status": "ok" if workers else "no_workers", "redis": True, "workers": len(workers),
              "slots": sum(w.slots for w in workers), "running": sum(w.running for w in workers)}
    if load is not None:
        answer |= {"model": model, "waiting": load.waiting}
    return JSONResponse(answer)
