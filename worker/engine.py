"""Iteration-level continuous batching over a Hugging Face causal LM.

All running sequences share one left-padded batch whose KV cache lives across
steps: a step feeds each sequence only its newest token. Newcomers are
prefilled together, then their cache is padded and concatenated onto the
running one; finished sequences are index-selected out at once. Explicit
position ids (`cumsum(mask) - 1`) keep every row's positions independent of
its padding, so a greedy completion does not depend on its batch-mates.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from common.protocol import SamplingParams, TokenLogprob
from worker.cache import new_cache
from worker.core import PromptTooLong, StepKind, StepOutput, StepResult
from worker.detokenizer import Detokenizer
from worker.model import LoadedModel
from worker.sampling import Logprobs, new_generator, sample
from worker.stops import StopMatcher

log = logging.getLogger("worker")


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    generator: torch.Generator | None
    stops: StopMatcher | None
    output_ids: list[int] = field(default_factory=list)

    def watches_stops(self) -> bool:
        """Stop strings count only once `min_tokens` are out, as in vLLM."""
        return self.stops is not None and len(self.output_ids) > self.params.min_tokens


@dataclass
class _Batch:
    """Row i of every tensor belongs to `sequences[i]`; `positions` is where each
    row's `last_tokens` entry sits, and it is not yet in the cache."""

    sequences: list[Sequence]
    cache: DynamicCache
    mask: torch.Tensor
    last_tokens: torch.Tensor
    positions: torch.Tensor

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.mask.device)
        self.sequences = [self.sequences[r] for r in rows]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.mask, self.last_tokens, self.positions = self.mask[index], self.last_tokens[index], self.positions[index]
        self._trim_padding()

    def _trim_padding(self) -> None:
        """Drop leading columns that are padding in every row (left by a long sequence that has left)."""
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        if start:
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]

    def extend(self, other: _Batch) -> None:
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.sequences += other.sequences
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(other.mask, width)])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width, dim=2), _pad_left(theirs.keys, width, dim=2)])
            mine.values = torch.cat([_pad_left(mine.values, width, dim=2), _pad_left(theirs.values, width, dim=2)])
        self.last_tokens = torch.cat([self.last_tokens, other.last_tokens])
        self.positions = torch.cat([self.positions, other.positions])


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `prompts` as one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _pad_left(tensor: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - dim - 1) + [missing, 0]
    return F.pad(tensor, pad)


class Engine:
    def __init__(self, loaded: LoadedModel, slots: int, static: bool = False) -> None:
        self.loaded = loaded
        self.slots = slots
        # Static batching (for comparison only): a batch is admitted when the last one has wholly finished.
        self.static = static
        self.waiting: deque[Sequence] = deque()
        self.batch: _Batch | None = None
        self.last_kind: StepKind = "decode"

    @property
    def running(self) -> list[Sequence]:
        batch = self.batch  # one read: the heartbeat thread asks while the loop may retire the batch
        return batch.sequences if batch else []

    @property
    def running_count(self) -> int:
        return len(self.running)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting)

    @property
    def cache_positions(self) -> int:
        """KV-cache positions held, padding included (rows x width)."""
        return self.batch.mask.numel() if self.batch else 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            resume: list[int] | None = None) -> None:
        """Queue a sequence. `resume` holds tokens another worker already delivered: they are
        prefilled with the prompt and generation continues after them."""
        if len(prompt_ids) + len(resume or []) >= self.loaded.max_length:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                f"{self.loaded.max_length} tokens, prompt and completion together")
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty after tokenisation")
        sequence = Sequence(request_id, prompt_ids, params, Detokenizer(self.loaded.tokenizer, prompt_ids),
                            new_generator(params, self.loaded.device),
                            StopMatcher(params.stop) if any(params.stop) else None)
        for token in resume or []:
            # Replaying the delivered tokens leaves any held-back text (a partial character, the start
            # of a stop string) exactly as the lost worker had it.
            sequence.output_ids.append(token)
            text = sequence.detokenizer.push(token)
            if sequence.watches_stops():
                sequence.stops.push(text, last=False)
        self.waiting.append(sequence)

    def cancel(self, request_id: str) -> bool:
        for sequence in self.waiting:
            if sequence.request_id == request_id:
                self.waiting.remove(sequence)
                return True
        rows = [i for i, s in enumerate(self.running) if s.request_id != request_id]
        if self.batch and len(rows) < len(self.batch.sequences):
            self._keep(rows)
            return True
        return False

    def abort_all(self) -> list[str]:
        """Forget every sequence (after a failed step); returns their ids so that their clients can be told."""
        dropped = [s.request_id for s in [*self.waiting, *self.running]]
        self.waiting.clear()
        self.batch = None
        return dropped

    @torch.inference_mode()
    def step(self) -> StepResult:
        """One forward: a prefill of the newcomers that fit, else a decode of the running batch.
        A prefill is always followed by a decode, so a stream of arrivals cannot stall running work."""
        room = self.slots - len(self.running)
        if self.waiting and room > 0 and self._admits():
            joiners = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            self.last_kind = "prefill"
            return StepResult("prefill", self._prefill(joiners))
        self.last_kind = "decode"
        return StepResult("decode", self._decode()) if self.batch else StepResult("idle")

    def _admits(self) -> bool:
        if self.static:
            return not self.running
        return not (self.last_kind == "prefill" and self.running)

    def _prefill(self, joiners: list[Sequence]) -> list[StepOutput]:
        fresh = [s for s in joiners if not s.output_ids]
        parts = [self._prompt_batch(fresh)] if fresh else []
        parts += [self._replayed(s) for s in joiners if s.output_ids]
        new, logits = parts[0][0], torch.cat([part_logits for _, part_logits in parts])
        for other, _ in parts[1:]:
            new.extend(other)
        if self.batch is None:
            self.batch = new
        else:
            self.batch.extend(new)
        return self._advance(logits, first_row=len(self.batch.sequences) - len(new.sequences))

    def _prompt_batch(self, sequences: list[Sequence]) -> tuple[_Batch, torch.Tensor]:
        """Prefill the prompts together; returns their batch and each one's last logits."""
        device = self.loaded.device
        contexts = [s.prompt_ids for s in sequences]
        ids, mask = left_padded(contexts, self.loaded.eos_token_ids[0], device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = new_cache(self.loaded.model.config)
        logits = self.loaded.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                                   use_cache=True, logits_to_keep=1).logits[:, -1]
        lengths = torch.tensor([len(c) for c in contexts], device=device)
        return _Batch(sequences, cache, mask, torch.zeros_like(lengths), lengths), logits

    def _replayed(self, sequence: Sequence) -> tuple[_Batch, torch.Tensor]:
        """A migrated sequence: its prompt prefilled, then each token already delivered fed as a decode step,
        as the lost worker computed them. One prefill over prompt and tokens would be faster but rounds
        differently, and with int8 activations that can change the greedy continuation."""
        batch, logits = self._prompt_batch([sequence])
        for token in sequence.output_ids:
            batch.last_tokens[0] = token
            logits = self._forward_one_token(batch)
        return batch, logits

    def _decode(self) -> list[StepOutput]:
        return self._advance(self._forward_one_token(self.batch), first_row=0)

    def _forward_one_token(self, batch: _Batch) -> torch.Tensor:
        """Feed each row its `last_tokens` entry; returns the logits of the next token."""
        batch.mask = F.pad(batch.mask, [0, 1], value=1)
        logits = self.loaded.model(input_ids=batch.last_tokens.unsqueeze(1), attention_mask=batch.mask,
                                   position_ids=batch.positions.unsqueeze(1), cache=batch.cache,
                                   use_cache=True).logits[:, -1]
        batch.positions = batch.positions + 1
        return logits

    def _advance(self, logits: torch.Tensor, first_row: int) -> list[StepOutput]:
        """Sample the next token of rows first_row.. (those `logits` belong to) and retire finished rows."""
        batch = self.batch
        sequences = batch.sequences[first_row:]
        picks = self._sample(logits, sequences)
        batch.last_tokens[first_row:] = torch.tensor([pick[0] if pick else 0 for pick in picks],
                                                     device=batch.last_tokens.device)
        outputs = [self._emit_or_fail(sequence, pick) for sequence, pick in zip(sequences, picks, strict=True)]
        keep = list(range(first_row)) + [row for row, out in enumerate(outputs, start=first_row)
                                         if out.finish_reason is None and out.error is None]
        if len(keep) < len(batch.sequences):
            self._keep(keep)
        return outputs

    def _sample(self, logits: torch.Tensor, sequences: list[Sequence]) -> list[tuple[int, Logprobs | None] | None]:
        """Each row's token and log-probabilities, in one call for the batch. Should that call raise, each row
        is sampled alone (rows are independent, so the picks are the same), and only rows that raise get None."""
        eos = self.loaded.eos_token_ids
        banned = [eos if s.params.ignore_eos or len(s.output_ids) < s.params.min_tokens else [] for s in sequences]

        def pick(rows: slice) -> list[tuple[int, Logprobs | None]]:
            chosen = sequences[rows]
            tokens, logprobs = sample(logits[rows], [s.params for s in chosen], [s.generator for s in chosen],
                                      banned[rows], [s.output_ids for s in chosen])
            return list(zip(tokens, logprobs, strict=True))

        try:
            return pick(slice(None))
        except Exception:
            log.exception("sampling failed for the batch; sampling its rows one by one")
        picks: list[tuple[int, Logprobs | None] | None] = []
        for row in range(len(sequences)):
            try:
                picks += pick(slice(row, row + 1))
            except Exception as exc:
                log.warning("sampling failed", extra={"request_id": sequences[row].request_id, "error": str(exc)})
                picks.append(None)
        return picks

    def _emit_or_fail(self, sequence: Sequence, pick: tuple[int, Logprobs | None] | None) -> StepOutput:
        """The row's StepOutput; a row whose token cannot be chosen or turned into text fails alone."""
        try:
            if pick is None:
                raise ValueError("no token could be sampled with these parameters")
            return self._emit(sequence, *pick)
        except Exception as exc:
            return StepOutput(sequence.request_id, -1, len(sequence.output_ids), "", None, len(sequence.prompt_ids),
                              error=str(exc))

    def _emit(self, sequence: Sequence, token: int, logprobs: Logprobs | None) -> StepOutput:
        """Append `token` to `sequence` and say what it adds: its text, less any held back for a possible
        stop string, and why the sequence ends, if it does."""
        sequence.output_ids.append(token)
        reason = self._finish_reason(sequence, token)
        text = "" if reason == "stop" else sequence.detokenizer.push(token)
        if sequence.watches_stops():
            # On the last token nothing stays held: text that waited on a stop string goes out with it.
            text, stopped = sequence.stops.push(text, last=reason is not None)
            reason = "stop" if stopped else reason
        output = StepOutput(sequence.request_id, token, len(sequence.output_ids) - 1, text, reason,
                            len(sequence.prompt_ids))
        if logprobs is not None:
            output.logprob, output.top_logprobs = self._token_logprobs(token, logprobs)
        return output

    def _token_logprobs(self, token: int, logprobs: Logprobs) -> tuple[TokenLogprob, list[TokenLogprob]]:
        decode = self.loaded.tokenizer.decode
        top = [TokenLogprob(decode([i]), value) for i, value in zip(logprobs.top_ids, logprobs.top_values, strict=True)]
        return TokenLogprob(decode([token]), logprobs.chosen), top

    def _finish_reason(self, sequence: Sequence, token: int) -> str | None:
        if token in self.loaded.eos_token_ids and not sequence.params.ignore_eos:
            return "stop"
        if len(sequence.output_ids) >= sequence.params.max_tokens:
            return "length"
        if len(sequence.prompt_ids) + len(sequence.output_ids) >= self.loaded.max_length:
            return "length"
        return None

    def _keep(self, rows: list[int]) -> None:
        if rows:
            self.batch.select(rows)
        else:
            self.batch = None
