"""The own engine: iteration-level continuous batching over a causal LM with a prefix cache and chunked
prefill, in nano-vllm's shape. Each step is schedule (worker/own/planner.py: which prompts prefill, the step's
kind), run (worker/own/runner.py: the forwards), sample (worker/sampling.py, under each grammar's mask) and
emit (worker/output.py: text, stops, finish reasons, as on every engine). docs/engine.md tells the algorithm:
blocks at fixed boundaries, groups, the ragged cache, and why no batch-mate changes a bit of a completion."""

from __future__ import annotations

import logging
from collections import deque

import torch

from common.protocol import SamplingParams
from worker import metrics
from worker.core import StepOutput, StepResult
from worker.output import OutputProcessor
from worker.own.cache import all_plain, new_cache
from worker.own.model import LoadedModel
from worker.own.planner import DEFAULT_CHUNK, Planner, PrefillGroup, Shape
from worker.own.runner import Runner
from worker.own.sequences import RunningBatch, Sequence
from worker.prefix import HeldPrefixes, PrefixStore, block_digests
from worker.sampling import new_generator, sample_texts
from worker.weights.quant import takes_blocks_together, takes_rows_alone

log = logging.getLogger("worker")

# A block's forward is the least a prefill step of its own can add between two decode steps (a chunk in a
# decode step may take less: chunk_tokens); a GPU needs many tokens per forward to be busy.
DEFAULT_BLOCK_CPU = 16
DEFAULT_BLOCK_CUDA = 256
DEFAULT_PREFIX_BYTES = 256 << 20  # in-process tests and benchmarks; a worker sizes its own (worker/prefix.py)


class Engine:
    name = "hf"

    def __init__(self, loaded: LoadedModel, slots: int, static: bool = False, block: int = 0,
                 chunk: int = DEFAULT_CHUNK, prefix_bytes: int = DEFAULT_PREFIX_BYTES) -> None:
        """`block`: tokens per prefill forward and per cached block (0: by device); `chunk`: tokens of each
        prompt one prefill step computes, in whole blocks (0: whole prompts); `prefix_bytes`: the prefix
        cache's bound (0: no cache); `static`: batches admitted whole (for comparison only)."""
        self.loaded = loaded
        self.slots = slots
        self.block = block or (DEFAULT_BLOCK_CUDA if loaded.device.type == "cuda" else DEFAULT_BLOCK_CPU)
        chunk_blocks = max(1, chunk // self.block) if chunk else 0
        # The int8 Llama's attention takes rows one by one: its cache holds them side by side, unpadded.
        self.ragged = takes_rows_alone(loaded.model)
        # Blocks can be padded, cut out and put back only where every cache layer holds plain keys and values
        # of every token; otherwise (sliding windows...) a group is one row and its last block unpadded.
        exact_blocks = all_plain(new_cache(loaded.model.config, self.ragged))
        # Whether a forward may take several blocks of a group: each token's every number as in its block's own
        # forward (the compiled int8 layer); other kernels' results may depend on the forward's shape.
        self.shape = Shape(mixes=self.ragged and bool(chunk_blocks), exact_blocks=exact_blocks,
                           blocks_together=exact_blocks and takes_blocks_together(loaded.model))
        self.store: PrefixStore[torch.Tensor] | None = (
            PrefixStore(prefix_bytes) if prefix_bytes and exact_blocks else None)
        self.routing = HeldPrefixes(self.store, self.block) if self.store is not None else None
        self.planner = Planner(slots, self.block, chunk_blocks, self.shape, self.store, static)
        self.runner = Runner(loaded, self.block, self.ragged, exact_blocks, self.store)
        self.output = OutputProcessor(loaded.tokenizer, loaded.eos_token_ids, loaded.max_length)
        self.batch: RunningBatch | None = None

    # -- what the worker loop reads

    @property
    def blocks_together(self) -> bool:
        return self.shape.blocks_together

    @property
    def waiting(self) -> deque[Sequence]:
        return self.planner.waiting

    @property
    def prefills(self) -> list[PrefillGroup]:
        return self.planner.prefills

    @property
    def running(self) -> list[Sequence]:
        batch = self.batch  # one read: the heartbeat thread asks while the loop may retire the batch
        return batch.sequences if batch else []

    @property
    def prefilling(self) -> list[Sequence]:
        return self.planner.prefilling

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

    # -- requests in and out

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            resume: list[int] | None = None, background: bool = False) -> None:
        """Queue a sequence. `resume` holds tokens another worker already delivered: they are
        prefilled with the prompt and generation continues after them."""
        resume = list(resume or [])
        text = self.output.open(request_id, prompt_ids, params, resume)
        text.matcher = self.loaded.grammars.matcher(params.grammar, resume) if params.grammar else None
        self.waiting.append(Sequence(text, prompt_ids, new_generator(params, self.loaded.device),
                                     block_digests(prompt_ids, self.block) if self.store is not None else [],
                                     background))

    def cancel(self, request_id: str) -> bool:
        if self.planner.cancel(request_id):
            return True
        rows = [i for i, s in enumerate(self.running) if s.request_id != request_id]
        if self.batch and len(rows) < len(self.batch.sequences):
            self._keep(rows)
            return True
        return False

    def request_ids(self) -> set[str]:
        return {s.request_id for s in [*self.waiting, *self.prefilling, *self.running]}

    def abort_all(self) -> list[str]:
        """Forget every sequence (after a failed step); returns their ids so that their clients can be told."""
        dropped = [s.request_id for s in [*self.planner.clear(), *self.running]]
        self.batch = None
        return dropped

    # -- one step: schedule, run, sample, emit

    @torch.inference_mode()
    def step(self) -> StepResult:
        # Whether batch lines run matters only to a prompt waiting for its prefill: no scan of the rows otherwise.
        waiting = self.planner.waiting or self.planner.prefills
        plan = self.planner.schedule(len(self.running), bool(waiting) and any(s.background for s in self.running))
        for prompt, cached in plan.looked_up:
            metrics.prefix_lookup(self.loaded.name, prompt, cached)
        if plan.kind == "mixed":
            return StepResult("mixed", self._mixed_step())
        if plan.kind == "prefill":
            return StepResult("prefill", self._prefill_step())
        if plan.kind == "decode":
            return StepResult("decode", self._advance(self.runner.forward_one_token(self.batch), first_row=0))
        return StepResult("idle")

    def _mixed_step(self) -> list[StepOutput]:
        """The running batch's decode and a chunk of one group in one pass; the rest of the chunk, if any, a
        block a forward."""
        group = self.planner.next_group()
        before = group.depth
        decode_logits, chunk_logits = self.runner.forward_mixed(self.batch, group, self.planner.mixed_tokens(group))
        outputs = self._advance(decode_logits, first_row=0)
        outputs += self._after_chunk(group, chunk_logits, before)
        return outputs + self._advance_group(group, self.planner.blocks_after_mixed())

    def _prefill_step(self) -> list[StepOutput]:
        blocks = self.planner.prefill_blocks(running=self.batch is not None)
        if blocks is None:  # unchunked: every prompt to its end in this step
            outputs = []
            while self.prefills:
                outputs += self._advance_group(self.prefills[0], blocks=None)
            return outputs
        return self._advance_group(self.planner.next_group(), blocks)

    def _advance_group(self, group: PrefillGroup, blocks: int | None) -> list[StepOutput]:
        """Up to `blocks` blocks of `group` (None: to its end), as many a forward as the planner allows."""
        outputs: list[StepOutput] = []
        done = 0
        while group.sequences and (blocks is None or done < blocks):
            count = self.planner.pass_blocks(group, None if blocks is None else blocks - done)
            before = group.depth
            outputs += self._after_chunk(group, self.runner.forward_chunk(group, count * self.block), before)
            done += count
        if not group.sequences and group in self.prefills:
            self.prefills.remove(group)
        return outputs

    def _after_chunk(self, group: PrefillGroup, logits: torch.Tensor, before: int) -> list[StepOutput]:
        """After a chunk of every row of `group` from depth `before`: the blocks it completed go to the prefix
        cache, and rows whose prompts end in it join the running batch."""
        self.runner.store_blocks(group, before)
        ended = [r for r, s in enumerate(group.sequences) if len(s.prompt_ids) <= group.depth]
        if not ended:
            return []
        joiners = [self.runner.ended(group, r, logits[r:r + 1]) for r in ended]
        group.select([r for r in range(len(group.sequences)) if r not in ended])
        new = joiners[0][0]
        for other, _ in joiners[1:]:
            new.extend(other)
        if self.batch is None:
            self.batch = new
        else:
            self.batch.extend(new)
        logits = torch.cat([row_logits for _, row_logits in joiners])
        return self._advance(logits, first_row=len(self.batch.sequences) - len(new.sequences))

    def _advance(self, logits: torch.Tensor, first_row: int) -> list[StepOutput]:
        """Sample and emit the next token of rows first_row.. (those `logits` belong to); finished rows leave."""
        batch = self.batch
        sequences = batch.sequences[first_row:]
        picks = sample_texts(logits, [s.text for s in sequences], [s.generator for s in sequences],
                             self.loaded.grammars, self.loaded.eos_token_ids, self.loaded.device)
        batch.last_tokens[first_row:] = torch.tensor([pick[0] if pick else 0 for pick in picks],
                                                     device=batch.last_tokens.device)
        outputs = [self.output.emit_pick(s.text, pick) for s, pick in zip(sequences, picks, strict=True)]
        keep = list(range(first_row)) + [row for row, out in enumerate(outputs, start=first_row)
                                         if out.finish_reason is None and out.error is None]
        if len(keep) < len(batch.sequences):
            self._keep(keep)
        return outputs

    def _keep(self, rows: list[int]) -> None:
        if rows:
            self.batch.select(rows)
        else:
            self.batch = None
