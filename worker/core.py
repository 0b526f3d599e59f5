"""The seam between the worker loop and an engine, free of torch: what a step returns and what the
loop may ask of an engine and a model. Four implement it: the own engine (ENGINE=hf, worker/own/),
vLLM's (ENGINE=vllm, worker/vllm/), llama.cpp's (ENGINE=llamacpp, worker/llamacpp/) and ENGINE=sim
(worker/sim.py, no torch); docs/architecture.md's "Adding an engine" says what a fifth needs."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

# What Engine.add raises, besides PromptTooLong, for a grammar it cannot enforce.
from common.errors import ErrorCode
from common.grammar import GrammarError as GrammarError
from common.protocol import Detokenize, SamplingParams, Submit, Tokenize, TokenLogprob, Tokens

# "mixed": a decode step that also carried a prefill chunk (worker/own/engine.py)
StepKind = Literal["prefill", "decode", "mixed", "idle"]


class PromptTooLong(ValueError):
    pass


class PromptInvalid(ValueError):
    """A prompt the model cannot read: token ids outside its vocabulary."""


def checked_ids(ids: list[int], vocab: int) -> list[int]:
    """A prompt's token ids, each a token of the model's vocabulary of `vocab`."""
    outside = next((t for t in ids if not 0 <= t < vocab), None)
    if outside is not None:
        raise PromptInvalid(f"the prompt names token {outside}; the model's vocabulary has {vocab} tokens")
    return list(ids)


class Queued(Protocol):
    @property
    def request_id(self) -> str: ...


Q = TypeVar("Q", bound=Queued)


def cancel_waiting(waiting: deque[Q], request_id: str) -> bool:
    """What an engine's cancel tries first: the request out of its waiting queue, if it is there still."""
    for sequence in waiting:
        if sequence.request_id == request_id:
            waiting.remove(sequence)
            return True
    return False


@dataclass
class StepOutput:
    """Token `index` of request `request_id`: its id, the text it adds (less any held back for a possible
    stop string), and why the request ends, if it does. `error` is set instead when this row alone failed;
    it has then left the engine. `error_code` says whose fault it was: the engine's, or the request's (a
    grammar that cannot be kept to is invalid_value)."""

    request_id: str
    token_id: int
    index: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    logprob: TokenLogprob | None = None
    top_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_code: ErrorCode = ErrorCode.ENGINE_ERROR


@dataclass
class StepResult:
    kind: StepKind
    outputs: list[StepOutput] = field(default_factory=list)


class PrefixRouting(Protocol):
    """What an engine with a prefix cache tells the scheduler, through the heartbeat, about what it holds."""

    def remember(self, keys: list, prompt_ids: list[int]) -> None: ...

    def held(self) -> list[int]: ...


class Engine(Protocol):
    name: str  # hf, vllm, llamacpp or sim: the heartbeat tells the gateway, which refuses what it cannot do
    slots: int
    routing: PrefixRouting | None  # None: no prefix cache (ENGINE=sim, or the cache turned off)

    @property
    def running_count(self) -> int: ...

    @property
    def waiting_count(self) -> int: ...

    @property
    def cache_positions(self) -> int: ...

    def has_work(self) -> bool: ...

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            resume: list[int] | None = None, background: bool = False) -> None:
        """Queue a request; `resume` holds tokens another worker already delivered; `background`: a batch job's
        line, which an engine may hold back for interactive requests. Raises PromptTooLong."""

    def cancel(self, request_id: str) -> bool: ...

    def request_ids(self) -> set[str]:
        """Every request it holds: waiting, prefilling or running."""

    def abort_all(self) -> list[str]:
        """Forget every request (after a failed step); returns their ids."""

    def step(self) -> StepResult: ...


class Model(Protocol):
    name: str
    max_length: int
    weights: str  # what the linear layers run on, for the worker's log: gguf, int8, none (or sim)

    @property
    def vocab(self) -> int: ...

    def prompt_ids(self, submit: Submit) -> list[int]: ...

    def answer(self, job: Tokenize | Detokenize) -> Tokens:
        """The token ids of a prompt or conversation, or the text of token ids."""
