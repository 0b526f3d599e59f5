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
    """A request as the gateway accepted it: a raw prompt or chat messages."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
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


class Cancel(msgspec.Struct, tag="cancel"):
    request_id: str


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
    # Text keys (common/prefix.py) of prompt prefixes whose blocks its prefix cache holds, the most recently
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

    # "seed" (/generate_stream), "completion" or "chat" (the OpenAI routes).
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
InboxMessage = Batch | Cancel | Tokenize | Detokenize
Result = Token | Done | Error
# What a worker answers a Tokenize or a Detokenize with.
Reply = Tokens | Error
WorkerEvent = Finished | Handoff | Returned

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


class Keys:
    """Redis key and channel names, all under one namespace, grouped by Redis Cluster hash tag (the part in
    braces, which alone picks a key's slot) so that every script and multi-key command touches one slot:
    the shared keys (queue, streams, counters, heartbeats, leases) share `{ns}`; a request's keys (results
    channel, progress, log, trace) share its request_id's tag; a worker's inbox and assignments its id's.
    On one server the tags are plain characters of the names."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    def _shared(self, name: str) -> str:
        return f"{{{self.ns}}}:{name}"

    def _request(self, kind: str, request_id: str) -> str:
        return f"{self.ns}:{kind}:{{{request_id}}}"

    def _worker(self, worker_id: str, kind: str) -> str:
        return f"{self.ns}:worker:{{{worker_id}}}:{kind}"

    @property
    def requests(self) -> str:
        return self._shared("requests")

    @property
    def events(self) -> str:
        return self._shared("events")

    @property
    def workers(self) -> str:
        return self._shared("workers")

    @property
    def models(self) -> str:
        """model name -> its ModelLoad, written by the leading scheduler."""
        return self._shared("models")

    def tokens(self, second: int) -> str:
        """Output tokens all gateways delivered in one second of Unix time (the cluster view's rate)."""
        return self._shared(f"tokens:{second}")

    def idempotency(self, tenant: str, key_digest: str) -> str:
        """An Idempotency-Key's claim: the request it names, per API key (gateway/idempotency.py)."""
        return f"{self.ns}:idempotency:{{{tenant}:{key_digest}}}"

    def heartbeat(self, worker_id: str) -> str:
        """Shared tag: the services read every worker's heartbeat with one MGET."""
        return self._shared(f"worker:{worker_id}")

    def inbox(self, worker_id: str) -> str:
        return self._worker(worker_id, "inbox")

    def worker_keys(self) -> str:
        """A SCAN pattern of every worker's own keys (inbox, assignments)."""
        namespace = "".join(f"\\{c}" if c in "*?[]\\" else c for c in self.ns)  # matched as written
        return f"{namespace}:worker:{{*}}:*"

    def worker_of(self, key: str) -> str | None:
        """The worker whose own key `key` is (one `worker_keys` matches), else None."""
        prefix = f"{self.ns}:worker:{{"
        worker_id, tag_closed, _kind = key.removeprefix(prefix).rpartition("}:")
        return worker_id if key.startswith(prefix) and tag_closed and worker_id else None

    def results(self, request_id: str) -> str:
        return self._request("out", request_id)

    def assigned(self, worker_id: str) -> str:
        """Hash of request_id -> Submit of what the scheduler gave this worker and it has not finished."""
        return self._worker(worker_id, "assigned")

    def progress(self, request_id: str) -> str:
        """List of the token ids a worker has delivered for this request, for resuming it elsewhere."""
        return self._request("progress", request_id)

    def log(self, request_id: str) -> str:
        """List of what was published for this request, for resuming its stream (common/resultlog.py):
        the bytes of results held, a header (the StreamMeta for a stream's first request_id, else empty),
        then each encoded result in order; kept RESUME_TTL seconds after the last one."""
        return self._request("log", request_id)

    @property
    def leases(self) -> str:
        """Sorted set of streams (their first request_id) scored by when, in Redis milliseconds, they are
        cancelled unless a gateway with a client reading them extends the lease first."""
        return self._shared("leases")

    def trace(self, request_id: str) -> str:
        """List of TraceEvent: the request's journey, kept for TRACE_TTL seconds."""
        return self._request("trace", request_id)

    @property
    def lease(self) -> str:
        """Which scheduler replica acts; the others stand by until it lapses."""
        return self._shared("scheduler:lease")

    @property
    def queued(self) -> str:
        """Counter of requests accepted but not yet dispatched, for admission control."""
        return self._shared("queued")

    @property
    def queued_bytes(self) -> str:
        """Counter of the encoded bytes of those requests: the queue is bounded in bytes too."""
        return self._shared("queued_bytes")

    def quota(self, tenant: str) -> str:
        """Hash of a tenant's quota window: the minute, its requests and its tokens (gateway/bus.py)."""
        return self._shared(f"quota:{tenant}")

    @property
    def quotas(self) -> str:
        """Hash of per-key quotas: tenant (an API key's digest) -> "requests_per_minute tokens_per_minute"."""
        return self._shared("quotas")

    @property
    def priority_floors(self) -> str:
        """Hash of tenant (an API key's digest) -> the lowest priority its requests run at (`llmserve quota`)."""
        return self._shared("priority_floors")

    def in_flight(self, tenant: str) -> str:
        """Sorted set of a tenant's requests still queued or running, scored by when each stops counting."""
        return self._shared(f"inflight:{tenant}")

    @property
    def clean_exit(self) -> str:
        """Set by a scheduler that stopped on a signal: its successor owes the pending entries no blame."""
        return self._shared("scheduler:clean_exit")

    @property
    def dead_letters(self) -> str:
        """Stream of requests set aside after they failed a service repeatedly, for an operator to read."""
        return self._shared("deadletter")


# Length caps of the streams: entries are deleted once consumed, so these bound only a backlog.
REQUEST_STREAM_MAXLEN = 100_000
EVENT_STREAM_MAXLEN = 100_000
INBOX_MAXLEN = 10_000
DEAD_LETTER_MAXLEN = 1_000

# A worker's inbox and assignments expire this long after the last write or renewal: the leading scheduler
# renews them while the worker lives and deletes them once it has moved the worker's work, so the expiry only
# reaps the keys of a worker that left while no scheduler watched. As long as a request's delivered tokens are
# kept (an hour from its first token), so that whatever could still be resumed can still be found.
WORKER_KEYS_TTL_SECONDS = 3600


SCHEDULER_GROUP = "scheduler"
PAYLOAD = b"m"
