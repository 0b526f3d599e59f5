"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Both generation routes share one flow (validate, submit every choice, stream chunks or collect
choices); a `Shape` (gateway/formats.py) holds what differs between a text completion and a chat
completion on the wire."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common.errors import ErrorCode
from common.protocol import Result, StreamMeta, Submit, Token
from gateway import idempotency, metrics
from gateway.bus import Bus
from gateway.chat_schemas import ChatCompletionRequest
from gateway.constraints import constraint_of
from gateway.errors import ApiError
from gateway.formats import EventResponse, Shape, chunk_events, usage
from gateway.schemas import CompletionRequest, OpenAIFields
from gateway.streams import gather, start
from gateway.submits import bus_of, serving, stream_meta, submits_for

router = APIRouter(prefix="/v1")


async def served_models(bus: Bus) -> list[str]:
    """The names live workers answer to, and the configured ones (MODEL, MODELS: requests for them wait for a
    worker)."""
    configured = {bus.settings.model, *bus.settings.model_names()}
    return sorted({name for w in await bus.view.live_workers() for name in w.serves()} | configured)


@router.get("/models", summary="The models the live workers serve")
async def list_models(request: Request) -> dict[str, object]:
    """Each name once, with the weights behind it (`root`, as vLLM says), how many live workers serve it, and
    what they run it on (their engines and weights paths)."""
    bus = bus_of(request)
    created = int(time.time())
    live = await bus.view.live_workers()
    data = []
    for name in await served_models(bus):
        workers = serving(live, name)
        data.append({"id": name, "object": "model", "created": created, "owned_by": "llmserve",
                     "root": workers[0].model if workers else name, "workers": len(workers),
                     "engines": sorted({w.engine for w in workers if w.engine}),
                     "weights": sorted({w.weights for w in workers if w.weights})})
    return {"object": "list", "data": data}


async def _prepare(request: Request, body: OpenAIFields, prompts: list[str | list[int] | None], logprobs: int | None,
                   chat: ChatCompletionRequest | None = None) -> list[Submit]:
    models = await served_models(bus_of(request))
    if body.model not in models:
        raise ApiError.of(ErrorCode.MODEL_NOT_FOUND, f"the model '{body.model}' does not exist; served: "
                          f"{', '.join(models)}", "model")
    # The rest of this request's task, its stream included, counts its metrics under its model.
    metrics.MODEL_NAME.set(body.model)
    messages = chat.chat_messages() if chat else None
    constraint = await constraint_of(request, body)
    return await submits_for(request, body, prompts, body.n, messages, logprobs, constraint.grammar,
                             constraint.tools, body.model)


async def submits_of(request: Request, body: CompletionRequest | ChatCompletionRequest) -> list[Submit]:
    """A validated body's Submits, each choice's, checked against what the live workers serve."""
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _prepare(request, body, [None], logprobs, chat=body)
    return await _prepare(request, body, body.prompt_list(), body.logprobs)


def answer_meta(request: Request, body: OpenAIFields, submits: list[Submit]) -> StreamMeta:
    chat = isinstance(body, ChatCompletionRequest)
    return stream_meta(request, submits, "chat" if chat else "completion", body.model, body.n, body.include_usage())


def whole_answer(meta: StreamMeta, collected: list[list[Result]]) -> dict[str, object]:
    """The body of a whole (not streamed) answer, from every choice's results in order, each ending in its Done."""
    shape = Shape.of(meta)
    choices, dones = [], []
    for index, results in enumerate(collected):
        tokens = [r for r in results if isinstance(r, Token)]
        done = results[-1]
        dones.append(done)
        choices.append(shape.choice(index, tokens, done.finish_reason, meta.request_ids[index]))
    return {**shape.head(meta), "object": shape.object, "choices": choices, "usage": usage(dones, meta.n)}


async def _respond(request: Request, body: OpenAIFields, submits: list[Submit]) -> Response:
    bus = bus_of(request)
    claimed, stream = await idempotency.attach_or_claim(request, submits)
    if stream is not None:  # a retry: the earlier request's stream, from its start
        meta = stream.meta
    else:
        meta = answer_meta(request, body, submits)
        # A whole answer keeps a results log only where a retry may ask for it again.
        stream = await idempotency.started(request, claimed, start(
            bus, request, submits, meta if body.stream or claimed else None, stop_on_error=body.stream))
    if body.stream:
        return EventResponse(stream, chunk_events(stream, Shape.of(meta), meta, body.continuous_usage()))
    collected = await gather(request, stream)
    return JSONResponse(whole_answer(meta, collected), headers={"X-Request-Id": meta.request_ids[0]})


@router.post("/completions", summary="OpenAI text completions, streamed or whole")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _respond(request, body, await submits_of(request, body))


@router.post("/chat/completions", summary="OpenAI chat completions, streamed or whole")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _respond(request, body, await submits_of(request, body))
