"""Typed messages on the Redis bus, encoded as msgpack with a size limit.

Every message is a tagged msgspec Struct: decoding checks the tag and every
field's type, so a malformed message raises `ProtocolError` instead of
reaching the code that consumes it.
"""

from __future__ import annotations

import time
from typing import Literal, TypeVar

import msgspec

from common.errors import ErrorCode

T = TypeVar("T")


class ProtocolError(ValueError):
    """A message on the bus that cannot be decoded or is too large."""


# A logit_bias this low (OpenAI's floor) bans the token outright rather than merely lowering it.
BAN_BIAS = 100.0


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 20
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 50
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: no log-probabilities; n >= 0: the chosen token's and the n most likely alternatives.
    logprobs: int | None = None
    # (token id, bias) pairs added to the row's logits before sampling; a bias of -100 or less bans the token.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # An llguidance grammar (common/grammar.py) every token must keep to; empty: none.
    grammar: str = ""


class ToolCall(msgspec.Struct, frozen=True):
    """A function call an assistant made earlier in the conversation; `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    # For a tool's answer: the call it answers.
    tool_call_id: str = ""


class Tool(msgspec.Struct, frozen=True):
    """A function the model may call: `parameters` is its JSON schema, as text."""

    name: str
    description: str = ""
    parameters: str = "{}"


class Submit(msgspec.Struct, tag="submit"):
    """A request as the gateway accepted it: a raw prompt (text or token ids) or chat messages."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # A prompt the client gave as token ids (/v1/completions), used as they are, in place of `prompt`.
    prompt_token_ids: list[int] | None = None
    # Functions the chat template (or common/toolcalls.py's prompt, for a template without tools) offers.
    tools: list[Tool] = msgspec.field(default_factory=list)
    submitted_at: float = 0.0
    # Epoch seconds after which a request still waiting in the queue is dropped (0: never).
    deadline: float = 0.0
    # After a worker loss: the tokens already delivered, which the next worker prefills and
    # continues from, and how many times the request has moved.
    resume: list[int] = msgspec.field(default_factory=list)
    migrations: int = 0
    # Whom the scheduler is fair to: an API key's digest, or one HTTP request's id when keys are off
    # (all the prompts and choices of one request share it).
    tenant: str = ""
    # The W3C traceparent of the gateway's span (common/tracing.py), when tracing is on: each hop's span joins it.
    traceparent: str = ""
    # The model the client named: only a worker that answers to it runs the request ('': any worker).
    model: str = ""
    # Lower runs first among its tenant's waiting requests (vLLM's meaning).
    priority: int = 0
    # A line of a batch job (/v1/batches): it waits in the background lane, which runs only what interactive
    # requests leave free (scheduler/policy.py).
    background: bool = False
    # Times a batch line handed its slot back to interactive requests (a Yield) and went back to the lane, with
    # its delivered tokens in `resume`: a yield is no migration (MIGRATION_LIMIT), and past YIELD_LIMIT
    # (scheduler/policy.py) a line runs to its end.
    yields: int = 0


class Cancel(msgspec.Struct, tag="cancel"):
    request_id: str


class Yield(msgspec.Struct, tag="yield"):
    """The scheduler asks a worker to hand back these batch lines' slots to interactive requests: each one it
    still runs leaves its engine and is told back in a Yielded event, its assignment and progress list left as
    they are for the scheduler to move it back to the background lane."""

    request_ids: list[str]


class Batch(msgspec.Struct, tag="batch"):
    """Sequences the scheduler admits to one worker in one go."""

    batch_id: str
    sequences: list[Submit]


class Tokenize(msgspec.Struct, tag="tokenize"):
    """Asks one worker for the token ids of a prompt, or of a conversation through its chat template, as a
    request would be given them; answered with Tokens (or an Error) on the request's results channel."""

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] = msgspec.field(default_factory=list)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    with_strings: bool = False


class Detokenize(msgspec.Struct, tag="detokenize"):
    """Asks one worker for the text of token ids; answered like Tokenize."""

    request_id: str
    tokens: list[int]


class Tokens(msgspec.Struct, tag="tokens"):
    tokens: list[int] = msgspec.field(default_factory=list)
    strings: list[str] | None = None  # each token's own text, when asked for
    text: str = ""  # a Detokenize's answer
    context: int = 0  # the model's context, in tokens


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token: str
    logprob: float


class Token(msgspec.Struct, tag="token", omit_defaults=True):
    """The text that token `index` of the completion added (empty while a multi-byte
    character is incomplete or while text might be the start of a stop string)."""

    index: int
    text: str
    logprob: TokenLogprob | None = None
    top_logprobs: list[TokenLogprob] | None = None


class Done(msgspec.Struct, tag="done"):
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int
    # Seconds between the gateway accepting the request and a worker admitting it.
    queue_s: float = 0.0


class Error(msgspec.Struct, tag="error"):
    code: ErrorCode
    message: str


class Finished(msgspec.Struct, tag="finished"):
    """A worker released the slot of `request_id` (done, failed or cancelled)."""

    worker_id: str
    request_id: str


class Returned(msgspec.Struct, tag="returned"):
    """A worker refused `request_id` without running it (it does not answer to the request's model: an older
    scheduler, or a race with a restart): the scheduler queues it again as it was."""

    worker_id: str
    request_id: str
    reason: str = ""


class Yielded(msgspec.Struct, tag="yielded"):
    """A worker stopped running `request_id` as a Yield asked, after publishing every token it had made of it:
    the scheduler puts it back in the queue with the tokens its progress list holds (its slot is free)."""

    worker_id: str
    request_id: str


class Unheld(msgspec.Struct, tag="unheld"):
    """Requests the worker's assignments name that it does not hold, at two of its checks (worker/ownership.py's
    Audit): their Batch or their ending was lost (a Redis failover drops the last writes). The scheduler moves each
    on as a lost worker's, or releases it where its owner key says it ended."""

    worker_id: str
    request_ids: list[str]


class Handoff(msgspec.Struct, tag="handoff"):
    """A worker told to stop left its running requests to the others: the scheduler moves them now,
    each with the tokens it has delivered, rather than waiting for the worker's heartbeat to lapse."""

    worker_id: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    worker_id: str
    model: str
    context: int
    slots: int
    running: int
    waiting: int
    finished_total: int
    sent_at: float
    draining: bool = False
    metrics_port: int = 0
    vocab: int = 0
    # Text keys (common/prefix_keys.py) of prompt prefixes whose blocks its prefix cache holds, the most recently
    # admitted first and at most a few hundred: the scheduler sends requests sharing them its way. They live
    # as long as the heartbeat key (WORKER_TTL).
    prefixes: list[int] = msgspec.field(default_factory=list)
    # The engine it hosts (hf, vllm, sim): the gateway refuses what that engine cannot do (gateway/engine_limits.py).
    engine: str = ""
    # The names it answers to (SERVED_MODEL_NAME); empty: `model` alone.
    names: list[str] = msgspec.field(default_factory=list)
    # What its linear layers run on (the own engine: gguf, int8 or none; worker/weights/paths.py), for /v1/models.
    weights: str = ""

    def serves(self) -> list[str]:
        return self.names or [self.model]


class ModelLoad(msgspec.Struct, tag="model_load"):
    """One model's work as the scheduler sees it: requests waiting for its workers, requests they run, and
    how many live workers answer to it."""

    waiting: int = 0
    running: int = 0
    workers: int = 0


class StreamMeta(msgspec.Struct, tag="stream"):
    """What resuming an HTTP stream needs to know of it, written by the gateway at admission as the
    header of the results log of its first request_id (`Keys.log`): the API and its answer's shape,
    and whom it belongs to."""

    # "seed" (/generate_stream, the native API: the name it has had on the wire since the first version),
    # "completion" or "chat" (the OpenAI routes).
    api: Literal["seed", "completion", "chat"]
    # One per choice (each prompt times n, in the order of the answer's choices); the first names the stream.
    request_ids: list[str]
    model: str = ""
    n: int = 1
    created: int = 0
    include_usage: bool = False
    # The Submit's tenant: the digest of the API key that created the stream (with API_KEYS), which alone
    # may resume it.
    tenant: str = ""
    keyed: bool = False
    # Chat answers are read for tool calls (common/toolcalls.py), which go out as `tool_calls`.
    tool_calls: bool = False


class TraceEvent(msgspec.Struct, array_like=True):
    """One hop of a request's journey, stamped by the service that made it."""

    hop: str
    service: str
    at: float
    detail: dict[str, str | int | float] = msgspec.field(default_factory=dict)


RequestMessage = Submit | Cancel
InboxMessage = Batch | Cancel | Yield | Tokenize | Detokenize
Result = Token | Done | Error
# What a worker answers a Tokenize or a Detokenize with.
Reply = Tokens | Error
WorkerEvent = Finished | Handoff | Returned | Yielded | Unheld

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[object, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct, limit: int) -> bytes:
    data = _encoder.encode(message)
    if len(data) > limit:
        raise ProtocolError(f"{type(message).__name__} message is {len(data)} bytes, over the {limit}-byte limit")
    return data


def decode(data: bytes, kind: type[T], limit: int) -> T:
    """Decode `data` as `kind` (a Struct or a union of them), or raise ProtocolError."""
    if len(data) > limit:
        raise ProtocolError(f"message is {len(data)} bytes, over the {limit}-byte limit")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc


def now() -> float:
    return time.time()
