"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Both generation routes share one flow (validate, submit every choice, stream
chunks or collect choices); a small `Shape` holds what differs between a text
completion and a chat completion on the wire."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.errors import ErrorCode
from common.protocol import Done, Error, Result, Submit, Token
from gateway.bus import Bus
from gateway.errors import ApiError
from gateway.routes import SSE_HEADERS, bus_of, sse, submits_for
from gateway.schemas import ChatCompletionRequest, CompletionRequest, OpenAIFields
from gateway.streams import api_error, collect, start

router = APIRouter(prefix="/v1")


async def served_models(bus: Bus) -> list[str]:
    """The models live workers serve, and the configured one (requests for it wait for a worker)."""
    return sorted({w.model for w in await bus.live_workers()} | {bus.settings.model})


@router.get("/models", summary="The models the live workers serve")
async def list_models(request: Request) -> dict[str, object]:
    created = int(time.time())
    models = await served_models(bus_of(request))
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "llmserve"}
                                       for m in models]}


@dataclass(frozen=True)
class Shape:
    """What a text completion and a chat completion write differently."""

    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice(self, index: int, text: str, tokens: list[Token], finish: str | None) -> dict[str, object]:
        body: dict[str, object] = {"index": index}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["text"] = text
        return {**body, "logprobs": self.logprobs(tokens), "finish_reason": finish}

    def delta(self, index: int, token: Token | None, first: bool, finish: str | None) -> dict[str, object]:
        tokens = [token] if token else []
        text = token.text if token else ""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": self.logprobs(tokens), "finish_reason": finish}
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if token:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": self.logprobs(tokens), "finish_reason": finish}

    def logprobs(self, tokens: list[Token]) -> dict[str, object] | None:
        scored = [t for t in tokens if t.logprob is not None]
        if not scored:
            return None
        if self.chat:
            return {"content": [{**_chat_logprob(t.logprob.token, t.logprob.logprob),
                                 "top_logprobs": [_chat_logprob(a.token, a.logprob) for a in t.top_logprobs or []]}
                                for t in scored]}
        offsets, offset = [], 0
        for t in scored:
            offsets.append(offset)
            offset += len(t.text)
        return {"tokens": [t.logprob.token for t in scored], "token_logprobs": [t.logprob.logprob for t in scored],
                "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs or []} for t in scored],
                "text_offset": offsets}


def _chat_logprob(token: str, logprob: float) -> dict[str, object]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def usage(dones: list[Done], n: int) -> dict[str, int]:
    """The prompt counts once per prompt, however many choices it has."""
    prompt = sum(d.prompt_tokens for d in dones[::n])
    completion = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _prepare(request: Request, body: OpenAIFields, prompts: list[str | None], logprobs: int | None,
                   chat: ChatCompletionRequest | None = None) -> list[Submit]:
    models = await served_models(bus_of(request))
    if body.model not in models:
        raise ApiError.of(ErrorCode.MODEL_NOT_FOUND, f"the model '{body.model}' does not exist; served: "
                          f"{', '.join(models)}", "model")
    messages = chat.chat_messages() if chat else None
    return await submits_for(request, body, prompts, body.n, messages, logprobs)


async def _chunks(stack: AsyncExitStack, shape: Shape, head: dict[str, object], n: int, include_usage: bool,
                  results: AsyncIterator[tuple[int, Result]]) -> AsyncIterator[bytes]:
    started: set[int] = set()
    dones: dict[int, Done] = {}
    async with stack:
        async for choice, result in results:
            if isinstance(result, Error):
                yield sse(api_error(result).body())
                break
            first = choice not in started
            started.add(choice)
            if isinstance(result, Token):
                if result.text or result.logprob is not None or first:
                    yield sse({**head, "choices": [shape.delta(choice, result, first, None)]})
            else:
                dones[choice] = result
                yield sse({**head, "choices": [shape.delta(choice, None, first, result.finish_reason)]})
        if include_usage and len(dones) == len(started) and dones:
            yield sse({**head, "choices": [], "usage": usage([dones[i] for i in sorted(dones)], n)})
    yield sse("[DONE]")


async def _respond(request: Request, body: OpenAIFields, shape: Shape, submits: list[Submit]) -> Response:
    bus = bus_of(request)
    rid = submits[0].request_id
    head = {"id": f"{'chatcmpl' if shape.chat else 'cmpl'}-{rid}", "object": shape.chunk_object,
            "created": int(time.time()), "model": body.model}
    if body.stream:
        stack, results = await start(bus, request, submits)
        return StreamingResponse(_chunks(stack, shape, head, body.n, body.include_usage(), results),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": rid})
    collected = await collect(bus, request, submits)
    choices, dones = [], []
    for index, results in enumerate(collected):
        tokens = [r for r in results if isinstance(r, Token)]
        done = results[-1]
        dones.append(done)
        choices.append(shape.choice(index, "".join(t.text for t in tokens), tokens, done.finish_reason))
    return JSONResponse({**head, "object": shape.object, "choices": choices, "usage": usage(dones, body.n)},
                        headers={"X-Request-Id": rid})


@router.post("/completions", summary="OpenAI text completions, streamed or whole")
async def completions(body: CompletionRequest, request: Request) -> Response:
    submits = await _prepare(request, body, body.prompt_list(), body.logprobs)
    return await _respond(request, body, Shape(chat=False), submits)


@router.post("/chat/completions", summary="OpenAI chat completions, streamed or whole")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    submits = await _prepare(request, body, [None], logprobs, chat=body)
    return await _respond(request, body, Shape(chat=True), submits)
