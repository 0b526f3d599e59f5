"""Tokens into what the worker sends, the same for every engine (vLLM v1's OutputProcessor, outside the engine
core): the prompt-length check, a sequence's text by the detokenizer and its stop strings (worker/detokenizer.py,
worker/stops.py; stop strings count once min_tokens are out, as in vLLM), the end of sequence, max_tokens and
the context as finish reasons, log-probabilities as text, and the replay of a migrated request's delivered
tokens, so that held-back text continues exactly where the lost worker left it. An engine only picks tokens:
it opens a sequence, emits each token it picks (with its own reason to end, if it has one: a grammar complete,
vLLM's), and reads from the sequence what it must feed back (`tokens`). The prompt check and the finish by length
are plain functions, for the worker loop and ENGINE=sim, which have no tokenizer."""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from common.errors import ErrorCode
from common.protocol import SamplingParams, TokenLogprob
from worker.core import GrammarError, PromptTooLong, StepOutput
from worker.detokenizer import Detokenizer
from worker.stops import StopMatcher

if TYPE_CHECKING:  # the prompt check and the finish decision serve ENGINE=sim, which has no transformers
    from transformers import PreTrainedTokenizerBase


def check_prompt(prompt_ids: Tokens[int], resume: Tokens[int], max_length: int) -> None:
    """Raise PromptTooLong for a prompt that is empty or leaves no room for a token in the context."""
    if not prompt_ids:
        raise PromptTooLong("the prompt is empty after tokenisation")
    if len(prompt_ids) + len(resume) >= max_length:
        raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                            f"{max_length} tokens, prompt and completion together")


def length_reason(params: SamplingParams, prompt_tokens: int, emitted: int, max_length: int) -> str | None:
    """"length" once `emitted` tokens are max_tokens or fill the context, else None."""
    if emitted >= params.max_tokens or prompt_tokens + emitted >= max_length:
        return "length"
    return None


def delivered_reason(params: SamplingParams, resume: Tokens[int]) -> str | None:
    """Why a migrated request ends on arrival, before any engine runs it: every token it may have was delivered
    (only its Done went missing). A delivered run that fills the context is the prompt check's to refuse."""
    return "length" if len(resume) >= params.max_tokens else None


@dataclass
class Logprobs:
    """Log-probabilities of one token under the model's own distribution, as an engine's sampler gives them: the
    chosen token's and the most likely ones', in rank order."""

    chosen: float
    top_ids: list[int]
    top_values: list[float]


class Matcher(Protocol):
    """A request's grammar as it checks each token (worker/grammar.py's LLMatcher)."""

    def consume_token(self, token: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def get_error(self) -> str: ...


@dataclass
class SequenceText:
    """One request's output so far: every token delivered (a migrated request's earlier ones included) and the
    text state they left."""

    request_id: str
    prompt_tokens: int
    params: SamplingParams
    detokenizer: Detokenizer
    stops: StopMatcher | None
    tokens: list[int] = field(default_factory=list)
    matcher: Matcher | None = None  # the grammar its tokens keep to, if any

    @property
    def emitted(self) -> int:
        return len(self.tokens)

    def watches_stops(self) -> bool:
        """Stop strings count only once `min_tokens` are out, as in vLLM."""
        return self.stops is not None and len(self.tokens) > self.params.min_tokens

    def holds_eos(self) -> bool:
        """Whether an end-of-sequence token may not be picked now: ignored, or min_tokens not yet out."""
        return self.params.ignore_eos or len(self.tokens) < self.params.min_tokens


class OutputProcessor:
    """The text side of every engine over one model's tokenizer, end-of-sequence ids and context."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Tokens[int], max_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_length = max_length

    def open(self, request_id: str, prompt_ids: Tokens[int], params: SamplingParams,
             resume: Tokens[int] = ()) -> SequenceText:
        """A request's output, with the tokens another worker delivered replayed as it emitted them. Raises
        PromptTooLong first (check_prompt): an engine opens a request before it builds anything for it (a
        grammar's matcher, which the engine sets on the sequence, must take the delivered tokens itself)."""
        check_prompt(prompt_ids, resume, self.max_length)
        sequence = SequenceText(request_id, len(prompt_ids), params, Detokenizer(self.tokenizer, list(prompt_ids)),
                                StopMatcher(params.stop) if any(params.stop) else None)
        for token in resume:
            sequence.tokens.append(token)
            self._text(sequence, token, last=False, eos=False)
        return sequence

    def emit(self, sequence: SequenceText, token: int, reason: str | None = None,
             logprobs: Logprobs | None = None) -> StepOutput:
        """Token `token` of `sequence` as a StepOutput: the text it adds, less any held back for a possible stop
        string, and why the sequence ends, if it does. `reason` is the engine's own (a grammar complete, vLLM's);
        else the end of sequence, max_tokens or the context end it; a stop string may end it first."""
        sequence.tokens.append(token)
        reason = reason or self._reason(sequence, token)
        # An end-of-sequence token that ends the text adds none; a grammar's last token does.
        eos = reason == "stop" and token in self.eos_token_ids
        text, stopped = self._text(sequence, token, last=reason is not None, eos=eos)
        reason = "stop" if stopped else reason
        output = StepOutput(sequence.request_id, token, sequence.emitted - 1, text, reason, sequence.prompt_tokens)
        if logprobs is not None:
            output.logprob, output.top_logprobs = self.logprobs(token, logprobs)
        return output

    def emit_pick(self, sequence: SequenceText, pick: tuple[int, Logprobs | None] | None) -> StepOutput:
        """A sampled row's output. `pick` is its token and log-probabilities, None where no token could be
        sampled; a row whose token breaks its grammar or cannot become text fails alone."""
        if pick is None:
            return self.fail(sequence, "no token could be sampled with these parameters")
        token, logprobs = pick
        reason = None
        matcher = sequence.matcher
        if matcher is not None:
            if token not in self.eos_token_ids and not matcher.consume_token(token):
                return self.fail(sequence, f"the grammar cannot be kept to: {matcher.get_error()}",
                                 ErrorCode.INVALID_VALUE)
            reason = "stop" if matcher.is_stopped() else None  # complete: it allows nothing more
        try:
            return self.emit(sequence, token, reason, logprobs)
        except Exception as exc:
            code = ErrorCode.INVALID_VALUE if isinstance(exc, GrammarError) else ErrorCode.ENGINE_ERROR
            return self.fail(sequence, str(exc), code)

    @staticmethod
    def fail(sequence: SequenceText, message: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> StepOutput:
        """The output that tells the worker `sequence` failed alone (it must leave its engine)."""
        return StepOutput(sequence.request_id, -1, sequence.emitted, "", None, sequence.prompt_tokens,
                          error=message, error_code=code)

    def logprobs(self, token: int, ranked: Logprobs) -> tuple[TokenLogprob, list[TokenLogprob]]:
        decode = self.tokenizer.decode
        top = [TokenLogprob(decode([i]), value) for i, value in zip(ranked.top_ids, ranked.top_values, strict=True)]
        return TokenLogprob(decode([token]), ranked.chosen), top

    def _reason(self, sequence: SequenceText, token: int) -> str | None:
        # A constrained answer ends at an end of sequence even with ignore_eos: its grammar allowed one.
        if token in self.eos_token_ids and (not sequence.params.ignore_eos or sequence.params.grammar):
            return "stop"
        return length_reason(sequence.params, sequence.prompt_tokens, sequence.emitted, self.max_length)

    @staticmethod
    def _text(sequence: SequenceText, token: int, last: bool, eos: bool) -> tuple[str, bool]:
        """The text `token` (already appended) adds, less what a stop string may still claim; whether a stop
        string completed. On the last token nothing stays held: text that waited on a stop string goes out with it."""
        text = "" if eos else sequence.detokenizer.push(token)
        if not sequence.watches_stops():
            return text, False
        return sequence.stops.push(text, last=last)
