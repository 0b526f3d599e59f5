"""From a validated HTTP body to the bus: one Submit per prompt and choice, and the StreamMeta a
stream of them is resumed with. Shared by the /generate routes and the OpenAI routes."""

from __future__ import annotations

import logging
import time

from fastapi import Request

from common.errors import ErrorCode
from common.protocol import ChatMessage, Heartbeat, StreamMeta, Submit, Tool
from common.tracing import Tracing
from gateway.bus import Bus
from gateway.engine_limits import refuse_unsupported
from gateway.errors import ApiError
from gateway.schemas import SamplingFields

log = logging.getLogger("gateway")


def bus_of(request: Request) -> Bus:
    return request.app.state.bus


def tenant_of(request: Request) -> str | None:
    """The digest of the API key that authorised the request (set by the Guard), if keys are on."""
    return getattr(request.state, "tenant", None)


async def submits_for(request: Request, body: SamplingFields, prompts: list[str | list[int] | None], choices: int = 1,
                      messages: list[ChatMessage] | None = None, logprobs: int | None = None, grammar: str = "",
                      tools: list[Tool] | None = None, model: str | None = None) -> list[Submit]:
    """One Submit per prompt and choice, each with its own request_id (choice i samples with seed + i),
    all of one tenant: the digest of the API key that authorised the request, or else the request's
    first request_id. They run on workers of `model` (by default MODEL, the gateway's own)."""
    bus = bus_of(request)
    model = model or bus.settings.model
    check_engine_bounds(serving(await bus.view.live_workers(), model), body, prompts)
    submits = [body.submit(prompt=p, messages=messages, seed_offset=i, logprobs=logprobs,
                           queue_timeout=bus.settings.queue_timeout, grammar=grammar, tools=tools)
               for p in prompts for i in range(choices)]
    tenant = tenant_of(request) or submits[0].request_id
    floor = await bus.view.priority_floor(tenant) if tenant_of(request) else None
    traceparent = Tracing.header(getattr(request.state, "span", None))
    for submit in submits:
        submit.tenant = tenant
        if floor is not None:  # a key kept from jumping the queue runs at its floor at best
            submit.priority = max(submit.priority, floor)
        submit.traceparent = traceparent
        submit.model = model
        log.info("received", extra={"request_id": submit.request_id, "model": model})
    request.state.request_id = submits[0].request_id
    return submits


def serving(workers: list[Heartbeat], model: str) -> list[Heartbeat]:
    """The workers that answer to `model`."""
    return [w for w in workers if model in w.serves()]


def stream_meta(request: Request, submits: list[Submit], api: str, model: str = "", n: int = 1,
                include_usage: bool = False) -> StreamMeta:
    return StreamMeta(api, [s.request_id for s in submits], model=model, n=n, created=int(time.time()),
                      include_usage=include_usage, tenant=submits[0].tenant, keyed=tenant_of(request) is not None,
                      tool_calls=bool(submits[0].tools))


def check_engine_bounds(workers: list[Heartbeat], body: SamplingFields,
                        prompts: list[str | list[int] | None] = ()) -> None:
    """The bounds only the live workers know: their context and their vocabulary (top_k, logit_bias and prompts
    of token ids; a worker that does not tell its vocabulary checks them itself), and what their engines cannot
    do."""
    refuse_unsupported({w.engine for w in workers}, body)
    contexts = [w.context for w in workers]
    if body.max_tokens is not None and contexts and body.max_tokens >= min(contexts):
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"max_tokens is {body.max_tokens}; the model's context is "
                          f"{min(contexts)} tokens, prompt and completion together", "max_tokens")
    vocab = min((w.vocab for w in workers if w.vocab > 0), default=None)
    if vocab is None:
        return
    if body.top_k > vocab:
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"top_k is {body.top_k}; the model's vocabulary has "
                          f"{vocab} tokens", "top_k")
    outside = [token for token, _ in body.token_biases() if token >= vocab]
    if outside:
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"logit_bias names token {outside[0]}; the model's vocabulary "
                          f"has {vocab} tokens", "logit_bias")
    outside = [token for prompt in prompts if isinstance(prompt, list) for token in prompt if token >= vocab]
    if outside:
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"the prompt names token {outside[0]}; the model's vocabulary "
                          f"has {vocab} tokens", "prompt")

