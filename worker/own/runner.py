"""The own engine's forwards: a prefill group's chunk, the running batch's decode step, or both in one pass (the
int8 Llama, worker/own/forward.py); the blocks a chunk completes put into the prefix cache; a row whose prompt is
done cut out as a batch of its own, a migrated one first fed the tokens it had delivered."""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker import metrics
from worker.own.cache import ROOM, block, new_cache, row_cache, stacked_cache
from worker.own.forward import Part, forward_parts
from worker.own.model import LoadedModel
from worker.own.sequences import PrefillGroup, RunningBatch, Sequence
from worker.prefix import PrefixStore


class Runner:
    def __init__(self, loaded: LoadedModel, block: int, ragged: bool, exact_blocks: bool,
                 store: PrefixStore[torch.Tensor] | None) -> None:
        """`ragged`: the int8 Llama's own forward over an unpadded cache; `exact_blocks`: groups of several rows,
        their last blocks padded (else a group is one row, unpadded)."""
        self.loaded, self.block, self.ragged, self.exact_blocks, self.store = loaded, block, ragged, exact_blocks, store

    def forward_chunk(self, group: PrefillGroup, tokens: int) -> torch.Tensor:
        """Forward [rows, tokens] at positions depth..; returns each row's logits at its last token in them (a
        row's last chunk is padded after its end, which causal attention keeps out of it)."""
        part = self._chunk_part(group, tokens)
        logits = self._forward(part, lambda: torch.ones(part.ids.shape[0], part.depth + part.ids.shape[1],
                                                        dtype=torch.long, device=part.ids.device))
        group.depth += part.ids.shape[1]
        return logits

    def forward_mixed(self, batch: RunningBatch, group: PrefillGroup, tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step of `batch` and `tokens` of `group`'s prompts in one pass: the logits of each."""
        chunk_part = self._chunk_part(group, tokens)
        decode_logits, chunk_logits = forward_parts(self.loaded.model, [self._decode_part(batch), chunk_part])
        batch.positions = batch.positions + 1
        group.depth += chunk_part.ids.shape[1]
        return decode_logits, chunk_logits

    def forward_one_token(self, batch: RunningBatch) -> torch.Tensor:
        """Feed each row its `last_tokens` entry; returns the logits of the next token."""
        logits = self._forward(self._decode_part(batch), lambda: batch.mask)
        batch.positions = batch.positions + 1
        return logits

    def store_blocks(self, group: PrefillGroup, before: int) -> None:
        """Put the blocks a chunk from depth `before` completed, of each row whose prompt fills them, into the
        prefix cache."""
        if self.store is None:
            return
        for index in range(before // self.block, group.depth // self.block):
            start = index * self.block
            for row, sequence in enumerate(group.sequences):
                if index < len(sequence.digests) and sequence.digests[index] not in self.store:
                    self.store.put(sequence.digests[index], block(group.cache, row, start, start + self.block),
                                   parents=sequence.digests[:index])
        metrics.PREFIX_BYTES.set(self.store.bytes)

    def ended(self, group: PrefillGroup, row: int, logits: torch.Tensor) -> tuple[RunningBatch, torch.Tensor]:
        """A row whose prompt is done, as a batch of its own (the padding after its end cut off) with the
        logits of its next token; a migrated sequence first replays the tokens it had delivered."""
        sequence = group.sequences[row]
        length = len(sequence.prompt_ids)
        # (Without exact blocks a group is one row, unpadded: its cache is the row's.)
        cache = row_cache(self.loaded.model.config, group.cache, row, length) if self.exact_blocks else group.cache
        device = self.loaded.device
        batch = RunningBatch([sequence], cache, torch.ones(1, length, dtype=torch.long, device=device),
                             torch.zeros(1, dtype=torch.long, device=device), torch.tensor([length], device=device))
        return batch, self._replayed(batch, sequence) if sequence.output_ids else logits

    def _replayed(self, batch: RunningBatch, sequence: Sequence) -> torch.Tensor:
        """Feed a migrated sequence's delivered tokens as decode steps, as the lost worker computed them (one
        prefill over prompt and tokens would be faster but rounds differently, and with int8 activations that
        can change the greedy continuation); returns the logits after the last."""
        for token in sequence.output_ids:
            batch.last_tokens[0] = token
            logits = self.forward_one_token(batch)
        return logits

    def _forward(self, part: Part, mask: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`part`'s logits: through the int8 Llama's own forward (worker/own/forward.py), else transformers' with
        the attention mask `mask` makes (a padded cache's)."""
        if self.ragged:
            return forward_parts(self.loaded.model, [part])[0]
        return self.loaded.logits(part.ids, mask(), part.positions, part.cache, part.last)

    def _chunk_part(self, group: PrefillGroup, tokens: int) -> Part:
        """The inputs of `group`'s next `tokens` tokens (its cache made at the first chunk)."""
        device, depth = self.loaded.device, group.depth
        if group.cache is None:
            # Room for the longest prompt, its padding and the first tokens after it: no copy while prefilling.
            room = max(len(s.prompt_ids) for s in group.sequences) + self.block + ROOM
            group.cache = stacked_cache(self.loaded.model.config, group.restored, self.ragged, room) \
                if group.restored else new_cache(self.loaded.model.config, self.ragged, room)
            group.restored = []
        pieces = [s.prompt_ids[depth:depth + tokens] for s in group.sequences]
        width = tokens if self.exact_blocks else len(pieces[0])
        pad = self.loaded.eos_token_ids[0]
        ids = torch.tensor([piece + [pad] * (width - len(piece)) for piece in pieces], device=device)
        positions = torch.arange(depth, depth + width, device=device).expand(len(pieces), width)
        last = torch.tensor([len(piece) - 1 for piece in pieces], device=device)
        return Part(ids, positions, group.cache, depth, last)

    @staticmethod
    def _decode_part(batch: RunningBatch) -> Part:
        """The inputs of the batch's decode step (its mask grown by the column they fill)."""
        batch.grow_mask()
        return Part(batch.last_tokens.unsqueeze(1), batch.positions.unsqueeze(1), batch.cache)
