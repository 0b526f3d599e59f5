"""ENGINE=llamacpp: llama.cpp's kernels (every GGUF quantisation and architecture it loads) behind worker/core.py's
seam, with the worker's own continuous batching, sampling, grammars and text.

Each step is one llama_decode of one batch: the newest token of every running sequence, then prompt chunks of the
sequences still prefilling, up to `chunk` prompt tokens (more while nothing runs); every sequence is its own
sequence id in one unified KV cache, so sequences join and leave at any step. A sequence's stream is its prompt
and every token it has delivered: a migrated request prefills the tokens another worker delivered with its prompt,
and a sequence put out of a full cache (the youngest) prefills its stream again when it is readmitted. Rows whose
stream is wholly in the cache are sampled together by the sampler the own engine also uses (worker/sampling.py: seeds,
penalties over every delivered token, logit_bias, log-probabilities) under their grammars' masks
(worker/grammar.py); tokens become text in worker/output.py, as on every engine."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.protocol import SamplingParams
from common.settings import WorkerSettings
from worker.core import StepKind, StepOutput, StepResult, cancel_waiting
from worker.llamacpp.library import DecodeError, NoRoom, Row
from worker.llamacpp.model import LlamaCppModel, load
from worker.output import OutputProcessor, SequenceText
from worker.sampling import Pick, new_generator, sample_texts

log = logging.getLogger("worker")

# Prompt tokens a step takes while nothing runs (no stream waits on it); with streams running, `chunk` (PREFILL_CHUNK).
IDLE_PASS_TOKENS = 256


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Sampling's few small tensors on this thread alone: torch's thread pool waking on cores where llama.cpp's
    OpenMP threads still spin after a decode cost more than the work (115 against 12 ms a step at one stream on
    2 cores)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Sequence:
    text: SequenceText
    prompt_ids: list[int]
    generator: torch.Generator | None
    seq: int = -1  # its sequence id in llama.cpp's cache while admitted
    cached: int = 0  # tokens of its stream in the cache

    @property
    def request_id(self) -> str:
        return self.text.request_id

    def stream(self) -> list[int]:
        return self.prompt_ids + self.text.tokens

    def ready(self) -> bool:
        """Whether all but its newest token are in the cache: its next step is a decode."""
        return self.cached == len(self.prompt_ids) + len(self.text.tokens) - 1 and bool(self.text.tokens)


class LlamaCppEngine:
    """worker/core.py's Engine over one llama.cpp context."""

    name = "llamacpp"
    routing = None  # no prefix cache reported for routing (yet)

    def __init__(self, model: LlamaCppModel, slots: int, chunk: int = WorkerSettings.prefill_chunk) -> None:
        self.model = model
        self.library = model.library
        self.slots = slots
        self.chunk = max(1, chunk)
        self.output = OutputProcessor(model.tokenizer, model.eos_token_ids, model.max_length)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []  # admitted (with a sequence id), oldest first
        self.free = list(range(slots))

    # -- what the worker loop reads

    @property
    def running_count(self) -> int:
        return sum(1 for s in list(self.running) if s.ready())

    @property
    def waiting_count(self) -> int:
        """Queued, or admitted and still prefilling (a migrated or readmitted stream too)."""
        return len(self.waiting) + sum(1 for s in list(self.running) if not s.ready())

    @property
    def cache_positions(self) -> int:
        return sum(s.cached for s in list(self.running))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- requests in and out

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            resume: list[int] | None = None, background: bool = False) -> None:
        resume = list(resume or [])
        text = self.output.open(request_id, prompt_ids, params, resume)
        text.matcher = self.model.grammars.matcher(params.grammar, resume) if params.grammar else None
        self.waiting.append(_Sequence(text, list(prompt_ids), new_generator(params, torch.device("cpu"))))

    def cancel(self, request_id: str) -> bool:
        if cancel_waiting(self.waiting, request_id):
            return True
        for sequence in self.running:
            if sequence.request_id == request_id:
                self._leave(sequence)
                return True
        return False

    def request_ids(self) -> set[str]:
        return {s.request_id for s in [*self.running, *self.waiting]}

    def abort_all(self) -> list[str]:
        dropped = [s.request_id for s in [*self.running, *self.waiting]]
        self.waiting.clear()
        self.running = []
        self.free = list(range(self.slots))
        self.library.clear()
        return dropped

    def _leave(self, sequence: _Sequence) -> None:
        """Out of the running list, its cells freed and its sequence id free again."""
        self.running.remove(sequence)
        self.library.forget(sequence.seq)
        self.free.append(sequence.seq)
        sequence.seq, sequence.cached = -1, 0

    # -- one step

    def step(self) -> StepResult:
        self._admit()
        while self.running:
            rows, sampled, kind = self._plan()
            try:
                logits = self.library.decode(rows)
            except NoRoom:
                self._put_out(self.running[-1])  # the youngest waits, and the others' step is tried again
                continue
            return StepResult(kind, self._advance(rows, sampled, torch.from_numpy(logits)))
        return StepResult("idle")

    def _admit(self) -> None:
        """Waiting sequences take free sequence ids while their streams fit the cells left."""
        held = sum(len(s.stream()) for s in self.running)
        while self.waiting and self.free:
            need = len(self.waiting[0].stream())
            if self.running and held + need + len(self.running) > self.library.cells:
                return
            sequence = self.waiting.popleft()
            sequence.seq = self.free.pop()
            self.running.append(sequence)
            held += need

    def _put_out(self, sequence: _Sequence) -> None:
        if len(self.running) == 1:
            raise DecodeError("the KV cache cannot hold one sequence")
        log.info("KV cache full: a sequence waits", extra={"request_id": sequence.request_id})
        self._leave(sequence)
        self.waiting.appendleft(sequence)

    def _plan(self) -> tuple[list[Row], list[_Sequence], StepKind]:
        """This step's batch: each running sequence's newest token, then prompt chunks oldest first; and the
        sequences whose next token is sampled after it, in the order of their logits."""
        rows: list[Row] = []
        sampled: list[_Sequence] = []
        decoding = [s for s in self.running if s.ready()]
        for sequence in decoding:
            rows.append(Row(sequence.text.tokens[-1], sequence.cached, sequence.seq, True))
            sampled.append(sequence)
        budget = self.chunk if decoding else IDLE_PASS_TOKENS
        budget = min(budget, self.library.capacity - len(rows))
        for sequence in self.running:
            if sequence.ready() or budget <= 0:
                continue
            stream = sequence.stream()
            start = sequence.cached  # below the stream's end: a sampled token always follows its last row
            end = min(len(stream), start + budget)
            for pos in range(start, end):
                rows.append(Row(stream[pos], pos, sequence.seq, pos == len(stream) - 1))
            if end == len(stream):
                sampled.append(sequence)
            budget -= end - start
        prefilling = len(rows) > len(decoding)
        kind: StepKind = "mixed" if decoding and prefilling else "decode" if decoding else "prefill"
        return rows, sampled, kind

    def _advance(self, rows: list[Row], sampled: list[_Sequence], logits: torch.Tensor) -> list[StepOutput]:
        # Every row fed is in the cache now: each sequence's rows are in order, so its last one counts.
        last = {row.seq: row.pos for row in rows}
        for sequence in self.running:
            if sequence.seq in last:
                sequence.cached = last[sequence.seq] + 1
        outputs = []
        for sequence, pick in zip(sampled, self._sample(logits, sampled), strict=True):
            output = self.output.emit_pick(sequence.text, pick)
            if output.finish_reason is not None or output.error is not None:
                self._leave(sequence)
            outputs.append(output)
        return outputs

    def _sample(self, logits: torch.Tensor, sequences: list[_Sequence]) -> list[Pick | None]:
        with one_torch_thread():
            return sample_texts(logits, [s.text for s in sequences], [s.generator for s in sequences],
                                self.model.grammars, self.model.eos_token_ids)


def build(settings: WorkerSettings) -> tuple[LlamaCppModel, LlamaCppEngine]:
    if settings.worker_batching != "continuous":
        raise ValueError("WORKER_BATCHING=static is the own engine's (ENGINE=hf); llama.cpp batches continuously")
    slots = settings.slots()
    chunk = max(1, settings.prefill_chunk)
    model = load(settings, slots, max(chunk, IDLE_PASS_TOKENS) + slots)
    log.info("llama.cpp engine", extra={"cells": model.library.cells, "slots": slots, "chunk": chunk,
                                        "context": model.max_length})
    return model, LlamaCppEngine(model, slots, chunk)
