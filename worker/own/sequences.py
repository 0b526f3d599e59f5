"""The own engine's sequences and the two batches they move through: a prefill group, whose rows advance through
their prompts together at one depth, and the running batch, whose rows decode one token a step. Row i of each
batch's tensors belongs to its `sequences[i]`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from worker.output import SequenceText
from worker.own.cache import join, pad_left, select_rows, trim_left


@dataclass
class Sequence:
    """One request: its output so far (worker/output.py), its prompt, its seeded generator and the digests of its
    prompt's whole blocks (the prefix cache's keys)."""

    text: SequenceText
    prompt_ids: list[int]
    generator: torch.Generator | None
    digests: list[bytes] = field(default_factory=list)
    background: bool = False  # a batch job's line: its prefill gives way to interactive ones

    @property
    def request_id(self) -> str:
        return self.text.request_id

    @property
    def output_ids(self) -> list[int]:
        return self.text.tokens


@dataclass
class RunningBatch:
    """The decoding rows; `positions` is where each row's `last_tokens` entry sits, not yet in the cache."""

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

    def extend(self, other: RunningBatch) -> None:
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.sequences += other.sequences
        self.mask = torch.cat([pad_left(self.mask, width), pad_left(other.mask, width)])
        join(self.cache, other.cache, width)
        self.last_tokens = torch.cat([self.last_tokens, other.last_tokens])
        self.positions = torch.cat([self.positions, other.positions])

    def grow_mask(self) -> torch.Tensor:
        """The mask with the column this step's tokens fill."""
        self.mask = F.pad(self.mask, [0, 1], value=1)
        return self.mask


@dataclass
class PrefillGroup:
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

    @property
    def interactive(self) -> bool:
        """Whether it holds a request of a client that waits (not only batch lines)."""
        return not all(s.background for s in self.sequences)

    def longest_left(self) -> int:
        """Tokens until its longest prompt is done."""
        return max(len(s.prompt_ids) for s in self.sequences) - self.depth

    def select(self, rows: list[int]) -> None:
        self.sequences = [self.sequences[r] for r in rows]
        self.restored = [self.restored[r] for r in rows] if self.restored else []
        if not rows:
            self.cache = None
        elif self.cache is not None:
            select_rows(self.cache, rows)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `prompts` as one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask
