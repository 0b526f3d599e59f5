"""The delivered tokens' presence penalty (worker/vllm/resume.py) on vLLM's V1 model runner: rows are batch
positions that vLLM moves and swaps, and each row's generated tokens are vLLM's own growing list. Imported only
where that interface exists (vLLM up to 0.33)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from worker.vllm.resume import delivered


@dataclass
class _Row:
    penalty: float
    pending: set[int]  # delivered tokens vLLM has not generated since
    output: list[int]  # vLLM's own list of the tokens it generated for the row, read as it grows
    seen: int = field(default=0)


class DeliveredPresence(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # a penalty can change the greedy choice

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _prompt, output in batch_update.added:
            owed = delivered(params)
            if owed is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = _Row(owed.penalty, set(owed.tokens), output)
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if second is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, tokens, penalties = [], [], []
        for index, row in self.rows.items():
            row.pending.difference_update(row.output[row.seen:])
            row.seen = len(row.output)
            rows += [index] * len(row.pending)
            tokens += row.pending
            penalties += [row.penalty] * len(row.pending)
        if rows:
            where = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
            logits[where] -= torch.tensor(penalties, dtype=logits.dtype, device=logits.device)
        return logits
