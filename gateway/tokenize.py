"""/tokenize and /detokenize, in vLLM's shapes. The tokenizer (and the chat template) live in the workers,
so the gateway asks one: it subscribes to a fresh request_id's channel, writes the question into a live
worker's inbox and waits for the answer, which the worker gives between two engine steps."""

from __future__ import annotations

import asyncio
import random

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from common.errors import ErrorCode
from common.protocol import Detokenize, Error, ProtocolError, Reply, Tokenize, Tokens
from gateway.chat_schemas import ChatRequestMessage, ToolDefinition
from gateway.errors import ApiError
from gateway.schemas import MAX_TOKENS, Text, new_request_id
from gateway.submits import bus_of, serving

router = APIRouter()

# How long an answer may take: a worker answers between two steps, so this covers a long prefill step on a
# busy CPU with room to spare.
ANSWER_SECONDS = 30.0
MAX_IDS = 1 << 17


class TokenizeRequest(BaseModel):
    """A prompt (as /v1/completions takes it), or messages (as /v1/chat/completions takes them)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatRequestMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    add_special_tokens: bool | None = Field(None, description="Default: true for a prompt, false for messages "
                                            "(the chat template adds its own)")
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: Text | None = None
    tokens: list[int] = Field(..., max_length=MAX_IDS)


async def _ask(request: Request, model: str | None, job: Tokenize | Detokenize) -> Tokens:
    bus = bus_of(request)
    live = [w for w in await bus.view.live_workers() if not w.draining]
    known = {name for w in live for name in w.serves()} | {bus.settings.model, *bus.settings.model_names()}
    if model is not None and model not in known:
        raise ApiError.of(ErrorCode.MODEL_NOT_FOUND, f"the model '{model}' does not exist", "model")
    # The tokenizer of the model named, or else of MODEL's workers (of any worker, if none serves MODEL).
    workers = serving(live, model or bus.settings.model) or ([] if model else live)
    if not workers:
        raise ApiError.of(ErrorCode.QUEUE_TIMEOUT, "no live worker to tokenize with; retry when one is up")
    worker = random.choice(workers)
    if isinstance(job, Detokenize) and worker.vocab and any(not 0 <= t < worker.vocab for t in job.tokens):
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"token ids must lie within the vocabulary (0 to "
                          f"{worker.vocab - 1})", "tokens")
    request.state.request_id = job.request_id
    async with bus.router.open([job.request_id], kind=Reply) as mailbox:
        try:
            await bus.tell(worker.worker_id, job)
        except ProtocolError:
            raise ApiError.of(ErrorCode.REQUEST_TOO_LARGE, "the request does not fit one bus message "
                              "(MAX_MESSAGE_BYTES)") from None
        try:
            _, reply = await asyncio.wait_for(mailbox.get(), ANSWER_SECONDS)
        except TimeoutError:
            raise ApiError.of(ErrorCode.QUEUE_TIMEOUT, f"the worker did not answer within {ANSWER_SECONDS:g} s") \
                from None
    if isinstance(reply, Error):
        raise ApiError.of_result(reply)
    return reply


@router.post("/tokenize", summary="The token ids of a prompt, or of messages through the chat template")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, object]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError.of(ErrorCode.INVALID_VALUE, "give exactly one of 'prompt' or 'messages'", "prompt")
    messages = [m.message(f"messages[{i}]") for i, m in enumerate(body.messages)] if body.messages else None
    special = body.add_special_tokens if body.add_special_tokens is not None else messages is None
    job = Tokenize(new_request_id(), body.prompt, messages, [t.tool() for t in body.tools or []], special,
                   body.add_generation_prompt, body.return_token_strs)
    answer = await _ask(request, body.model, job)
    return {"count": len(answer.tokens), "max_model_len": answer.context, "tokens": answer.tokens,
            "token_strs": answer.strings}


@router.post("/detokenize", summary="The text of token ids")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    if any(t < 0 or t > MAX_TOKENS for t in body.tokens):
        raise ApiError.of(ErrorCode.INVALID_VALUE, "token ids must be non-negative 32-bit integers", "tokens")
    answer = await _ask(request, body.model, Detokenize(new_request_id(), body.tokens))
    return {"prompt": answer.text}
