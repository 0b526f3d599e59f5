"""ENGINE=sim: a worker with no model, so that the control plane (gateway, Redis,
scheduler, fan-out) can be measured and scaled past what the CPU model allows.
Each step sleeps SIM_STEP_MS + SIM_STEP_PER_SEQ_MS x batch and gives every running
sequence one word of a fixed vocabulary. For measurements only, never the default:
it knows no end-of-sequence, stop strings or sampling (no tokenizer: worker/output.py's
OutputProcessor does not run here), but checks prompts and decides "length" with that
module's own functions, so a request runs to `max_tokens` or its context, as on any engine."""

from __future__ import annotations

import time
import zlib
from collections import deque
from dataclasses import dataclass, field

from common.protocol import ChatMessage, Detokenize, SamplingParams, Submit, Tokenize, Tokens
from worker.core import StepOutput, StepResult, checked_ids
from worker.output import check_prompt, length_reason

VOCAB = (
    " the", " of", " and", " to", " in", " is", " that", " it", " was", " for", " on", " are", " as", " with",
    " his", " they", " at", " be", " this", " from", " have", " or", " by", " one", " had", " not", " but", " what",
    " all", " were", " when", " we", " there", " can", " an", " your", " which", " their", " said", " if", " do",
    " will", " each", " about", " how", " up", " out", " them", " then", " she", " many", " some", " so", " these",
    " would", " other", " into", " has", " more", " her", " two", " like", " him", " see", " time", " could", " no",
    " make", " than", " first", " been", " its", " who", " now", " people",
)


@dataclass
class SimModel:
    """What a worker needs of a model: a name, a context length, what its weights are, and prompt token ids."""

    name: str = "sim"
    weights: str = "sim"  # no weights: the test double's tokens
    max_length: int = 8192
    vocab: int = len(VOCAB)

    def prompt_ids(self, submit: Submit) -> list[int]:
        if submit.prompt_token_ids is not None:
            return checked_ids(submit.prompt_token_ids, self.vocab)
        return self._ids(submit.prompt, submit.messages)

    def answer(self, job: Tokenize | Detokenize) -> Tokens:
        if isinstance(job, Detokenize):
            return Tokens(text="".join(VOCAB[t % len(VOCAB)] for t in job.tokens), context=self.max_length)
        ids = self._ids(job.prompt, job.messages)
        return Tokens(ids, [VOCAB[t] for t in ids] if job.with_strings else None, context=self.max_length)

    @staticmethod
    def _ids(prompt: str | None, messages: list[ChatMessage] | None) -> list[int]:
        text = prompt if prompt is not None else " ".join(m.content for m in messages or [])
        return [zlib.crc32(word.encode()) % len(VOCAB) for word in text.split()] or [0]


@dataclass
class SimSequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)


def sim_token(position: int) -> int:
    """The token at a position of the whole sequence: the same alone or in any batch."""
    return position % len(VOCAB)


class SimEngine:
    """The Engine's interface, with a sleep for a forward pass."""

    name = "sim"
    cache_positions = 0
    routing = None

    def __init__(self, model: SimModel, slots: int, step_s: float, per_sequence_s: float,
                 static: bool = False) -> None:
        self.model = model
        self.slots = slots
        self.static = static
        self.step_s = step_s
        self.per_sequence_s = per_sequence_s
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []

    @property
    def running_count(self) -> int:
        return len(self.running)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            resume: list[int] | None = None, background: bool = False) -> None:
        check_prompt(prompt_ids, resume or [], self.model.max_length)
        self.waiting.append(SimSequence(request_id, prompt_ids, params, list(resume or [])))

    def cancel(self, request_id: str) -> bool:
        before = len(self.waiting) + len(self.running)
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.running = [s for s in self.running if s.request_id != request_id]
        return len(self.waiting) + len(self.running) < before

    def request_ids(self) -> set[str]:
        return {s.request_id for s in [*self.waiting, *self.running]}

    def abort_all(self) -> list[str]:
        dropped = [s.request_id for s in [*self.waiting, *self.running]]
        self.waiting.clear()
        self.running = []
        return dropped

    def step(self) -> StepResult:
        admits = not (self.static and self.running)
        while admits and self.waiting and len(self.running) < self.slots:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return StepResult("idle")
        time.sleep(self.step_s + self.per_sequence_s * len(self.running))
        outputs = []
        for sequence in self.running:
            token = sim_token(len(sequence.prompt_ids) + len(sequence.output_ids))
            sequence.output_ids.append(token)
            reason = length_reason(sequence.params, len(sequence.prompt_ids), len(sequence.output_ids),
                                   self.model.max_length)
            outputs.append(StepOutput(sequence.request_id, token, len(sequence.output_ids) - 1, VOCAB[token],
                                      reason, len(sequence.prompt_ids)))
        ended = {output.request_id for output in outputs if output.finish_reason is not None}
        self.running = [s for s in self.running if s.request_id not in ended]
        return StepResult("decode", outputs)
