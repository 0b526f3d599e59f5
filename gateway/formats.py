"""How a ResultStream reaches the client: the /generate routes' events and the OpenAI chunks, each event with
its id (gateway/sse.py), the same for a stream and for its resumption; and the response that
ends the stream however the connection ends."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from common import toolcalls
from common.protocol import Done, Error, StreamMeta, Token
from gateway.errors import ApiError
from gateway.sse import COMPLETE, MEDIA_TYPE, SSE_HEADERS, sse
from gateway.streams import ResultStream

log = logging.getLogger("gateway")


class EventResponse(StreamingResponse):
    """The SSE response of a ResultStream. However the response ends (the last event sent, the client
    gone, the task cancelled), the stream is closed: a client that left mid-stream leaves a stream that
    may be resumed to its lease."""

    def __init__(self, stream: ResultStream, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type=MEDIA_TYPE, headers={**SSE_HEADERS, "X-Request-Id": stream.head})
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()


def done_fields(request_id: str, done: Done) -> dict[str, object]:
    return {"sequence_id": request_id, "finish_reason": done.finish_reason, "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens}


async def generate_events(stream: ResultStream) -> AsyncIterator[bytes]:
    """/generate_stream's events: one per token, then the end (or an `error` event)."""
    rid = stream.head
    async for _, result in stream:
        if isinstance(result, Token):
            event = sse({"token": result.text, "sequence_id": rid, "index": result.index}, event_id=stream.current_id)
        elif isinstance(result, Done):
            log.info("delivered", extra={"request_id": rid, "finish_reason": result.finish_reason})
            event = sse(done_fields(rid, result), event_id=stream.current_id)
        else:
            event = sse({"sequence_id": rid, "error": {"message": result.message, "code": result.code}},
                        event="error", event_id=stream.current_id)
        yield stream.preamble() + event
    stream.sent_all = True


@dataclass(frozen=True)
class Shape:
    """What a text completion and a chat completion write differently; a chat answer that may call tools is
    read for its calls (common/toolcalls.py)."""

    chat: bool
    tool_calls: bool = False

    @classmethod
    def of(cls, meta: StreamMeta) -> Shape:
        return cls(meta.api == "chat", meta.api == "chat" and meta.tool_calls)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def answer_id(self, request_id: str) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"

    def head(self, meta: StreamMeta) -> dict[str, object]:
        """The fields every chunk of a stream repeats."""
        return {"id": self.answer_id(meta.request_ids[0]), "object": self.chunk_object, "created": meta.created,
                "model": meta.model}

    def choice(self, index: int, tokens: list[Token], finish: str, request_id: str) -> dict[str, object]:
        """A whole answer's choice."""
        text = "".join(t.text for t in tokens)
        body: dict[str, object] = {"index": index}
        if not self.chat:
            body["text"] = text
        elif self.tool_calls:
            parser = toolcalls.CallParser()
            answer = toolcalls.parse(parser.feed(text) + parser.finish())
            body["message"] = {"role": "assistant", "content": answer.content}
            if answer.calls:
                body["message"]["tool_calls"] = [
                    {"id": toolcalls.call_id(request_id, i), "type": "function",
                     "function": {"name": name, "arguments": arguments}}
                    for i, (name, arguments) in enumerate(answer.calls)]
                finish = "tool_calls" if finish == "stop" else finish
        else:
            body["message"] = {"role": "assistant", "content": text}
        return {**body, "logprobs": self.logprobs(tokens), "finish_reason": finish}

    def delta(self, index: int, token: Token | None, first: bool, finish: str | None,
              calls: ToolDeltas | None = None) -> dict[str, object]:
        tokens = [token] if token else []
        text = token.text if token else ""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": self.logprobs(tokens), "finish_reason": finish}
        delta: dict[str, object] = {"role": "assistant"} if first else {}
        if calls is not None:
            delta.update(calls.delta(text, ended=token is None))
            finish = "tool_calls" if finish == "stop" and calls.parser.started else finish
        elif token:
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


@dataclass
class ToolDeltas:
    """One choice's text read for tool calls, as the deltas OpenAI streams: content, or `tool_calls` entries
    (the first of a call with its id and name, then pieces of its arguments). Everything one token adds goes
    in one delta, so that one event id stands for it whole."""

    request_id: str
    parser: toolcalls.CallParser

    def delta(self, text: str, ended: bool = False) -> dict[str, object]:
        events = self.parser.feed(text) + (self.parser.finish() if ended else [])
        delta: dict[str, object] = {}
        content = "".join(e.text for e in events if isinstance(e, toolcalls.Content))
        if content:
            delta["content"] = content
        entries: dict[int, dict] = {}
        for event in events:
            if isinstance(event, toolcalls.CallStart):
                entries[event.index] = {"index": event.index, "id": toolcalls.call_id(self.request_id, event.index),
                                        "type": "function", "function": {"name": event.name, "arguments": ""}}
            elif isinstance(event, toolcalls.Arguments):
                entry = entries.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += event.text
        if entries:
            delta["tool_calls"] = list(entries.values())
        return delta


def _chat_logprob(token: str, logprob: float) -> dict[str, object]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def usage(dones: list[Done], n: int) -> dict[str, int]:
    """The prompt counts once per prompt, however many choices it has."""
    prompt = sum(d.prompt_tokens for d in dones[::n])
    completion = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage_so_far(stream: ResultStream, n: int) -> dict[str, int]:
    """Usage of what the stream has seen: an ended choice's own counts, else the tokens seen of it. A prompt
    counts once its first choice has ended, as only the worker's end tells it."""
    seen = stream.positions
    completion = sum(d.completion_tokens if (d := seen.dones.get(c)) else seen.tokens[c]
                     for c in range(len(stream.request_ids)))
    prompt = sum(d.prompt_tokens for c in range(0, len(stream.request_ids), n) if (d := seen.dones.get(c)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(stream: ResultStream, head: dict[str, object], choice: dict[str, object], continuous: bool,
           n: int) -> bytes:
    body = {**head, "choices": [choice]}
    if continuous:
        body["usage"] = usage_so_far(stream, n)
    return stream.preamble() + sse(body, event_id=stream.current_id)


async def chunk_events(stream: ResultStream, shape: Shape, meta: StreamMeta,
                       continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """An OpenAI stream: a chunk per token and per choice's end, each with its id (and, with continuous usage,
    the usage so far); the first error ends it. Then the usage chunk, if asked for, also when the stream ended
    early (cancelled or failed): billing sees every token generated; and `data: [DONE]`, written together."""
    head = shape.head(meta)
    calls = _tool_deltas(stream) if shape.tool_calls else None
    async for choice, result in stream:
        if isinstance(result, Error):
            yield stream.preamble() + sse(ApiError.of_result(result).body(), event_id=stream.current_id)
            break
        first = stream.positions.is_first(choice, result)
        reader = calls[choice] if calls else None
        if isinstance(result, Token):
            delta = shape.delta(choice, result, first, None, reader)
            says = bool(delta["delta"]) if reader else bool(result.text)
            if says or result.logprob is not None or first:
                yield _chunk(stream, head, delta, continuous_usage, meta.n)
        else:
            yield _chunk(stream, head, shape.delta(choice, None, first, result.finish_reason, reader),
                         continuous_usage, meta.n)
    last = stream.preamble()
    if meta.include_usage:
        last += sse({**head, "choices": [], "usage": _final_usage(stream, meta.n)}, event_id=stream.current_id)
    yield last + sse("[DONE]", event_id=COMPLETE)
    stream.sent_all = True


def _tool_deltas(stream: ResultStream) -> list[ToolDeltas]:
    """A reader per choice, brought up to where the client stands by the text it already has (a resume)."""
    readers = [ToolDeltas(rid, toolcalls.CallParser()) for rid in stream.request_ids]
    for reader, earlier in zip(readers, stream.earlier, strict=True):
        reader.parser.feed("".join(token.text for token in earlier))
    return readers


def _final_usage(stream: ResultStream, n: int) -> dict[str, int]:
    dones = stream.positions.dones
    if len(dones) == len(stream.request_ids):
        return usage([dones[i] for i in sorted(dones)], n)
    return usage_so_far(stream, n)
