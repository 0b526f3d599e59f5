"""Iteration-level continuous batching over a Hugging Face causal LM, with a prefix cache and chunked prefill.

Prefill. Every prompt is prefilled in blocks of `block` tokens at fixed boundaries from its first token (its
last block padded to full size after its end, where causal attention keeps the padding out of the real
tokens), each block by one forward over the keys and values of the blocks before it. Sequences admitted
together at one depth form a group that advances together, a chunk of blocks per prefill step, so a long
prompt arrives across steps interleaved with decode steps of the running batch; for the int8 Llama a chunk
rides in the decode step itself, one pass over both (worker/hf/forward.py). Each forward has the shape
[rows, block] over a cache without padding, and the kernels compute its rows independently: a block's keys
and values depend only on the tokens up to its end. The compiled int8 layer computes every token of a run of
blocks as its own block's forward would (worker/weights/quant.py's takes_blocks_together), so there a chunk is one
forward of any number of tokens: in a decode step, fewer the deeper it is in its prompt (chunk_tokens), and
with nothing running up to IDLE_PASS_TOKENS. So a prompt whose leading
blocks are in the prefix cache (worker/prefix.py) takes them from there and computes the rest exactly as it
would have, and neither the cache, nor the chunking, nor group-mates change a bit of its output.

Decode. A finished prefill joins the running batch, whose KV cache lives across steps, each step feeding
every sequence only its newest token; finished sequences leave at once. For the int8 Llama (the CPU default)
the cache holds rows side by side without padding (worker/hf/cache.py): a newcomer costs one copy of its own
tokens, a leaver none. Other models keep one left-padded batch: the newcomer's cache is padded and
concatenated onto the running one. Explicit position ids (`cumsum(mask) - 1`) keep every row's positions
independent of its padding, so a greedy completion does not depend on its batch-mates.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from common.errors import ErrorCode
from common.protocol import SamplingParams, TokenLogprob
from common.settings import Settings
from worker import metrics
from worker.core import GrammarError, PromptTooLong, StepKind, StepOutput, StepResult
from worker.detokenizer import Detokenizer
from worker.hf.cache import (
    ROOM,
    all_plain,
    block,
    join,
    new_cache,
    pad_left,
    row_cache,
    select_rows,
    stacked_cache,
    trim_left,
)
from worker.hf.forward import Part, forward_parts
from worker.hf.grammar import LLMatcher
from worker.hf.model import LoadedModel
from worker.hf.sampling import Logprobs, Pick, new_generator, sample_each
from worker.prefix import HeldPrefixes, PrefixStore, block_digests
from worker.stops import StopMatcher
from worker.weights.quant import takes_blocks_together, takes_rows_alone

log = logging.getLogger("worker")


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    generator: torch.Generator | None
    stops: StopMatcher | None
    digests: list[bytes] = field(default_factory=list)  # of the prompt's whole blocks, for the prefix cache
    output_ids: list[int] = field(default_factory=list)
    matcher: LLMatcher | None = None  # the grammar its tokens keep to, if any

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
        select_rows(self.cache, rows)
        self.mask, self.last_tokens, self.positions = self.mask[index], self.last_tokens[index], self.positions[index]
        self._trim_padding()

    def _trim_padding(self) -> None:
        """Drop leading columns that are padding in every row (left by a long sequence that has left)."""
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        if start:
            self.mask = self.mask[:, start:]
            trim_left(self.cache, start)

    def extend(self, other: _Batch) -> None:
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.sequences += other.sequences
        self.mask = torch.cat([pad_left(self.mask, width), pad_left(other.mask, width)])
        join(self.cache, other.cache, width)
        self.last_tokens = torch.cat([self.last_tokens, other.last_tokens])
        self.positions = torch.cat([self.positions, other.positions])


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `prompts` as one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@dataclass
class _Prefill:
    """Sequences whose prompts advance together: every row holds `depth` tokens in `cache`, so a block forward
    needs no padding. Until its first forward the group has no cache; `restored` then holds each row's blocks
    from the prefix cache (when `depth` > 0), and newcomers at the same depth may still join it."""

    sequences: list[Sequence]
    depth: int
    order: int  # when the group formed: the lowest is the oldest
    restored: list[list[torch.Tensor]] = field(default_factory=list)
    cache: DynamicCache | None = None

    def remaining(self, block: int) -> int:
        """Blocks until its longest prompt is done."""
        return max(-(-(len(s.prompt_ids) - self.depth) // block) for s in self.sequences)

    def select(self, rows: list[int]) -> None:
        self.sequences = [self.sequences[r] for r in rows]
        self.restored = [self.restored[r] for r in rows] if self.restored else []
        if not rows:
            self.cache = None
        elif self.cache is not None:
            select_rows(self.cache, rows)


# A block's forward is the least a prefill step of its own can add between two decode steps (a chunk in a
# decode step may take less: chunk_tokens); a GPU needs many tokens per forward to be busy.
DEFAULT_BLOCK_CPU = 16
DEFAULT_BLOCK_CUDA = 256
DEFAULT_CHUNK = Settings.prefill_chunk
# Prompt tokens a prefill step may take while no sequence is running, and one forward of several blocks at most.
IDLE_PASS_TOKENS = 256
DEFAULT_PREFIX_BYTES = Settings.prefix_cache_bytes
# Cached keys whose attention costs a prompt token about as much as the rest of its forward (the default model on
# 2 CPU cores: bench/chunked_prefill.py's mixed steps), and the fewest tokens a chunk takes in a decode step.
ATTENTION_KEYS_PER_TOKEN = 1024
MIN_CHUNK_TOKENS = 4


def chunk_tokens(chunk: int, depth: int) -> int:
    """Tokens of a prompt's next chunk in a decode step, `depth` tokens into it: `chunk` at its start, fewer
    deeper in, where each token also attends over every key before it, so that a chunk adds about the same time
    to the running streams' step at any depth."""
    deep = chunk * ATTENTION_KEYS_PER_TOKEN // (ATTENTION_KEYS_PER_TOKEN + depth)
    return min(chunk, max(MIN_CHUNK_TOKENS, deep))


class Engine:
    name = "hf"

    def __init__(self, loaded: LoadedModel, slots: int, static: bool = False, block: int = 0,
                 chunk: int = DEFAULT_CHUNK, prefix_bytes: int = DEFAULT_PREFIX_BYTES) -> None:
        """`block`: tokens per prefill forward and per cached block (0: by device); `chunk`: tokens of each
        prompt one prefill step computes, in whole blocks (0: whole prompts); `prefix_bytes`: the prefix
        cache's bound (0: no cache)."""
        self.loaded = loaded
        self.slots = slots
        # Static batching (for comparison only): a batch is admitted when the last one has wholly finished.
        self.static = static
        self.block = block or (DEFAULT_BLOCK_CUDA if loaded.device.type == "cuda" else DEFAULT_BLOCK_CPU)
        self.chunk_blocks = max(1, chunk // self.block) if chunk else 0
        # The int8 Llama's attention takes rows one by one: its cache holds them side by side, unpadded.
        self.ragged = takes_rows_alone(loaded.model)
        # Blocks can be padded, cut out and put back only where every cache layer holds plain keys and values
        # of every token; otherwise (sliding windows...) a group is one row and its last block unpadded.
        self.exact_blocks = all_plain(self._new_cache())
        # Whether a forward may take several blocks of a group: each token's every number as in its block's own
        # forward (the compiled int8 layer); other kernels' results may depend on the forward's shape.
        self.blocks_together = self.exact_blocks and takes_blocks_together(loaded.model)
        self.store: PrefixStore[torch.Tensor] | None = (
            PrefixStore(prefix_bytes) if prefix_bytes and self.exact_blocks else None)
        self.routing = HeldPrefixes(self.store, self.block) if self.store is not None else None
        self.waiting: deque[Sequence] = deque()
        self.prefills: list[_Prefill] = []
        self.batch: _Batch | None = None
        self.last_kind: StepKind = "decode"
        self.groups_formed = 0
        self.prefill_turns = 0

    def _new_cache(self) -> DynamicCache:
        return new_cache(self.loaded.model.config, self.ragged)

    @property
    def running(self) -> list[Sequence]:
        batch = self.batch  # one read: the heartbeat thread asks while the loop may retire the batch
        return batch.sequences if batch else []

    @property
    def prefilling(self) -> list[Sequence]:
        return [s for group in list(self.prefills) for s in group.sequences]

    @property
    def running_count(self) -> int:
        return len(self.running)

    @property
    def waiting_count(self) -> int:
        """Admitted and not yet producing tokens: queued for a prefill, or in one."""
        return len(self.waiting) + len(self.prefilling)

    @property
    def cache_positions(self) -> int:
        """KV-cache positions held (a padded cache: padding included, rows x width), prefills included."""
        held = sum(len(group.sequences) * group.depth for group in list(self.prefills))
        batch = self.batch
        if batch is None:
            return held
        return held + (int(batch.mask.sum()) if self.ragged else batch.mask.numel())

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefills or self.running)

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
                            StopMatcher(params.stop) if any(params.stop) else None,
                            block_digests(prompt_ids, self.block) if self.store is not None else [],
                            matcher=self.loaded.grammars.matcher(params.grammar, resume or [])
                            if params.grammar else None)
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
        for group in self.prefills:
            rows = [i for i, s in enumerate(group.sequences) if s.request_id != request_id]
            if len(rows) < len(group.sequences):
                if rows:
                    group.select(rows)
                else:
                    self.prefills.remove(group)
                return True
        rows = [i for i, s in enumerate(self.running) if s.request_id != request_id]
        if self.batch and len(rows) < len(self.batch.sequences):
            self._keep(rows)
            return True
        return False

    def abort_all(self) -> list[str]:
        """Forget every sequence (after a failed step); returns their ids so that their clients can be told."""
        dropped = [s.request_id for s in [*self.waiting, *self.prefilling, *self.running]]
        self.waiting.clear()
        self.prefills = []
        self.batch = None
        return dropped

    @torch.inference_mode()
    def step(self) -> StepResult:
        """One step: a decode of the running batch that also carries the next chunk of one prefill group (the
        int8 Llama: one pass over both, worker/hf/forward.py), or a prefill step (a chunk of one group's prompts;
        those that end in it join the running batch with their first token), or a decode. Other models
        alternate: a prefill step is always followed by a decode. So neither arrivals nor long prompts hold
        running sequences up for more than a chunk."""
        mixing = bool(self.ragged and self.chunk_blocks) and self.batch is not None
        if mixing or self.batch is None or self.last_kind != "prefill":
            self._start_prefills()
            if self.prefills:
                self.last_kind = "mixed" if mixing else "prefill"
                return StepResult(self.last_kind, self._mixed_step() if mixing else self._prefill_step())
        self.last_kind = "decode"
        return StepResult("decode", self._decode()) if self.batch else StepResult("idle")

    def _mixed_step(self) -> list[StepOutput]:
        group, batch = self._next_group(), self.batch
        chunk_part = self._chunk_part(group, self._mixed_tokens(group))
        decode_logits, chunk_logits = forward_parts(self.loaded.model, [self._decode_part(batch), chunk_part])
        batch.positions = batch.positions + 1
        before = group.depth
        group.depth += chunk_part.ids.shape[1]
        outputs = self._advance(decode_logits, first_row=0)
        outputs += self._after_chunk(group, chunk_logits, before)
        # (Elsewhere the rest of the chunk, a block a forward; and a group that has ended leaves the list.)
        return outputs + self._advance_group(group, 0 if self.blocks_together else self.chunk_blocks - 1)

    def _mixed_tokens(self, group: _Prefill) -> int:
        """Tokens of `group`'s chunk in this decode step: one block where a forward's shape may change its bits;
        else chunk_tokens' share, up to the group's end and IDLE_PASS_TOKENS over its rows. (Whatever their
        number, each token's keys and values are those its block's own forward computes, so a prompt's blocks
        in the prefix cache stay the same.)"""
        if not self.blocks_together:
            return self.block
        left = max(len(s.prompt_ids) for s in group.sequences) - group.depth
        most = chunk_tokens(self.chunk_blocks * self.block, group.depth)
        return max(MIN_CHUNK_TOKENS, min(most, left, IDLE_PASS_TOKENS // len(group.sequences)))

    def _start_prefills(self) -> None:
        """Move waiting sequences, as slots allow, into prefill groups at the depth of their cached prefix.
        One whose next block another prefill is computing waits for it, to take it from the cache then."""
        if self.static and (self.batch or self.prefills):
            return
        room = self.slots - len(self.running) - len(self.prefilling)
        computing = {digest for group in self.prefills for s in group.sequences
                     for digest in s.digests[group.depth // self.block:]}
        held: list[Sequence] = []
        while self.waiting and room > 0:
            sequence = self.waiting.popleft()
            cacheable = min(len(sequence.digests), (len(sequence.prompt_ids) - 1) // self.block)
            cached = self.store.longest(sequence.digests[:cacheable]) if self.store is not None else 0
            if cached < cacheable and sequence.digests[cached] in computing:
                held.append(sequence)
                continue
            computing.update(sequence.digests[cached:])
            self._join_group(sequence, cached)
            room -= 1
        self.waiting.extendleft(reversed(held))

    def _join_group(self, sequence: Sequence, cached: int) -> None:
        depth = cached * self.block
        if self.store is not None:
            metrics.prefix_lookup(self.loaded.name, len(sequence.prompt_ids), depth)
        group = next((g for g in self.prefills if g.cache is None and g.depth == depth and self.exact_blocks), None)
        if group is None:
            group = _Prefill([], depth, self.groups_formed)
            self.groups_formed += 1
            self.prefills.append(group)
        group.sequences.append(sequence)
        if cached:
            group.restored.append(self.store.take(sequence.digests[:cached]))

    def _prefill_step(self) -> list[StepOutput]:
        if not self.chunk_blocks:  # unchunked: every prompt to its end in this step
            outputs = []
            while self.prefills:
                outputs += self._advance_group(self.prefills[0], blocks=None)
            return outputs
        # With nothing running, no stream waits on this step: a longer one costs only the other prefills a pass.
        blocks = self.chunk_blocks if self.batch else max(self.chunk_blocks, IDLE_PASS_TOKENS // self.block)
        return self._advance_group(self._next_group(), blocks)

    def _next_group(self) -> _Prefill:
        """Turns alternate: the group nearest its end (a short prompt need not wait behind a long one), then
        the oldest (so that none waits forever)."""
        self.prefill_turns += 1
        if self.prefill_turns % 2:
            return min(self.prefills, key=lambda g: (g.remaining(self.block), g.order))
        return min(self.prefills, key=lambda g: g.order)

    def _advance_group(self, group: _Prefill, blocks: int | None) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        done = 0
        while group.sequences and (blocks is None or done < blocks):
            count = self._pass_blocks(group, IDLE_PASS_TOKENS // self.block if blocks is None else blocks - done)
            before = group.depth
            outputs += self._after_chunk(group, self._forward_chunk(group, count * self.block), before)
            done += count
        if not group.sequences and group in self.prefills:
            self.prefills.remove(group)
        return outputs

    def _pass_blocks(self, group: _Prefill, most: int) -> int:
        """Blocks of `group` one forward takes: up to `most` (and the group's end) where the layers compute a
        run of blocks as each block's own forward would, else one. At most IDLE_PASS_TOKENS over all its rows:
        the attention's working memory grows with rows times tokens."""
        if not self.blocks_together:
            return 1
        fits = IDLE_PASS_TOKENS // (self.block * len(group.sequences))
        return max(1, min(most, group.remaining(self.block), fits))

    def _after_chunk(self, group: _Prefill, logits: torch.Tensor, before: int) -> list[StepOutput]:
        """After a chunk of every row of `group` from depth `before`: the blocks it completed go to the prefix
        cache, and rows whose prompts end in it join the running batch."""
        for index in range(before // self.block, group.depth // self.block):
            self._store_block(group, index)
        ended = [r for r, s in enumerate(group.sequences) if len(s.prompt_ids) <= group.depth]
        if not ended:
            return []
        joiners = [self._ended(group, r, logits[r:r + 1]) for r in ended]
        group.select([r for r in range(len(group.sequences)) if r not in ended])
        return self._join(joiners)

    def _forward_chunk(self, group: _Prefill, tokens: int) -> torch.Tensor:
        """Forward [rows, tokens] at positions depth..; returns each row's logits at its last token in them (a
        row's last chunk is padded after its end, which causal attention keeps out of it)."""
        part = self._chunk_part(group, tokens)
        logits = self._forward(part, lambda: torch.ones(part.ids.shape[0], part.depth + part.ids.shape[1],
                                                        dtype=torch.long, device=part.ids.device))
        group.depth += part.ids.shape[1]
        return logits

    def _forward(self, part: Part, mask: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`part`'s logits: through the int8 Llama's own forward (worker/hf/forward.py), else transformers' with
        the attention mask `mask` makes (a padded cache's)."""
        if self.ragged:
            return forward_parts(self.loaded.model, [part])[0]
        return self.loaded.logits(part.ids, mask(), part.positions, part.cache, part.last)

    def _chunk_part(self, group: _Prefill, tokens: int) -> Part:
        """The inputs of `group`'s next `tokens` tokens (its cache made at the first chunk)."""
        device, depth = self.loaded.device, group.depth
        if group.cache is None:
            # Room for the longest prompt, its padding and the first tokens after it: no copy while prefilling.
            room = max(len(s.prompt_ids) for s in group.sequences) + self.block + ROOM
            config = self.loaded.model.config
            group.cache = stacked_cache(config, group.restored, self.ragged, room) if group.restored \
                else new_cache(config, self.ragged, room)
            group.restored = []
        pieces = [s.prompt_ids[depth:depth + tokens] for s in group.sequences]
        width = tokens if self.exact_blocks else len(pieces[0])
        pad = self.loaded.eos_token_ids[0]
        ids = torch.tensor([piece + [pad] * (width - len(piece)) for piece in pieces], device=device)
        positions = torch.arange(depth, depth + width, device=device).expand(len(pieces), width)
        last = torch.tensor([len(piece) - 1 for piece in pieces], device=device)
        return Part(ids, positions, group.cache, depth, last)

    def _store_block(self, group: _Prefill, index: int) -> None:
        """Put block `index`, computed, of each row whose prompt fills it into the prefix cache."""
        if self.store is None:
            return
        start = index * self.block
        for row, sequence in enumerate(group.sequences):
            if index < len(sequence.digests) and sequence.digests[index] not in self.store:
                self.store.put(sequence.digests[index], block(group.cache, row, start, start + self.block),
                               parents=sequence.digests[:index])
        metrics.PREFIX_BYTES.set(self.store.bytes)

    def _ended(self, group: _Prefill, row: int, logits: torch.Tensor) -> tuple[_Batch, torch.Tensor]:
        """A row whose prompt is done, as a batch of its own (the padding after its end cut off) with the
        logits of its next token; a migrated sequence first replays the tokens it had delivered."""
        sequence = group.sequences[row]
        length = len(sequence.prompt_ids)
        # (Without exact blocks a group is one row, unpadded: its cache is the row's.)
        cache = row_cache(self.loaded.model.config, group.cache, row, length) if self.exact_blocks else group.cache
        device = self.loaded.device
        batch = _Batch([sequence], cache, torch.ones(1, length, dtype=torch.long, device=device),
                       torch.zeros(1, dtype=torch.long, device=device), torch.tensor([length], device=device))
        return batch, self._replayed(batch, sequence) if sequence.output_ids else logits

    def _replayed(self, batch: _Batch, sequence: Sequence) -> torch.Tensor:
        """Feed a migrated sequence's delivered tokens as decode steps, as the lost worker computed them (one
        prefill over prompt and tokens would be faster but rounds differently, and with int8 activations that
        can change the greedy continuation); returns the logits after the last."""
        for token in sequence.output_ids:
            batch.last_tokens[0] = token
            logits = self._forward_one_token(batch)
        return logits

    def _join(self, joiners: list[tuple[_Batch, torch.Tensor]]) -> list[StepOutput]:
        new = joiners[0][0]
        for other, _ in joiners[1:]:
            new.extend(other)
        logits = torch.cat([row_logits for _, row_logits in joiners])
        if self.batch is None:
            self.batch = new
        else:
            self.batch.extend(new)
        return self._advance(logits, first_row=len(self.batch.sequences) - len(new.sequences))

    def _decode(self) -> list[StepOutput]:
        return self._advance(self._forward_one_token(self.batch), first_row=0)

    def _forward_one_token(self, batch: _Batch) -> torch.Tensor:
        """Feed each row its `last_tokens` entry; returns the logits of the next token."""
        logits = self._forward(self._decode_part(batch), lambda: batch.mask)
        batch.positions = batch.positions + 1
        return logits

    @staticmethod
    def _decode_part(batch: _Batch) -> Part:
        """The inputs of the batch's decode step (its mask grown by the column they fill)."""
        batch.mask = F.pad(batch.mask, [0, 1], value=1)
        return Part(batch.last_tokens.unsqueeze(1), batch.positions.unsqueeze(1), batch.cache)

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

    def _sample(self, logits: torch.Tensor, sequences: list[Sequence]) -> list[Pick | None]:
        """Each row's token and log-probabilities (None for a row whose sampling failed)."""
        eos = self.loaded.eos_token_ids
        banned = [eos if s.params.ignore_eos or len(s.output_ids) < s.params.min_tokens else [] for s in sequences]
        grammar = self.loaded.grammars.row_biases([s.matcher for s in sequences], self.loaded.device) \
            if any(s.matcher is not None for s in sequences) else [None] * len(sequences)
        return sample_each(logits, [s.params for s in sequences], [s.generator for s in sequences], banned,
                           [s.output_ids for s in sequences], grammar, [s.request_id for s in sequences])

    def _emit_or_fail(self, sequence: Sequence, pick: Pick | None) -> StepOutput:
        """The row's StepOutput; a row whose token cannot be chosen or turned into text fails alone."""
        try:
            if pick is None:
                raise ValueError("no token could be sampled with these parameters")
            return self._emit(sequence, *pick)
        except Exception as exc:
            code = ErrorCode.INVALID_VALUE if isinstance(exc, GrammarError) else ErrorCode.ENGINE_ERROR
            return StepOutput(sequence.request_id, -1, len(sequence.output_ids), "", None, len(sequence.prompt_ids),
                              error=str(exc), error_code=code)

    def _emit(self, sequence: Sequence, token: int, logprobs: Logprobs | None) -> StepOutput:
        """Append `token` to `sequence` and say what it adds: its text, less any held back for a possible
        stop string, and why the sequence ends, if it does."""
        sequence.output_ids.append(token)
        if sequence.matcher is not None and token not in self.loaded.eos_token_ids \
                and not sequence.matcher.consume_token(token):
            raise GrammarError(f"the grammar cannot be kept to: {sequence.matcher.get_error()}")
        reason = self._finish_reason(sequence, token)
        # An end-of-sequence token that ends the text adds none; a grammar's last token does.
        ended_by_eos = reason == "stop" and token in self.loaded.eos_token_ids
        text = "" if ended_by_eos else sequence.detokenizer.push(token)
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
        if token in self.loaded.eos_token_ids and (not sequence.params.ignore_eos or sequence.matcher is not None):
            return "stop"
        if sequence.matcher is not None and sequence.matcher.is_stopped():
            return "stop"  # the grammar is complete and allows nothing more
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
