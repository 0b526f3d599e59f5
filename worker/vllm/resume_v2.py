"""The delivered tokens' presence penalty (worker/vllm/resume.py) on vLLM's Model Runner V2 (CUDA, and x86 CPUs
from vLLM 0.34). State is kept per request slot; a step's logits rows map to slots through the step's context,
and what vLLM generated for a slot is read from the runner's token buffer (committed tokens from the prompt's end
to the slot's total length), on the device, with no copy back to the host. Draft tokens of speculative decoding
are not yet committed and so not counted."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

from worker.vllm.resume import delivered


def _on_device(buffer: Any) -> torch.Tensor:
    """The runner's buffers keep their device copy as `.gpu` (on CPU runners too)."""
    return buffer.gpu if hasattr(buffer, "gpu") else buffer


class DeliveredPresenceV2(LogitsProcessor):
    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        self.state = req_states
        self.rows: dict[int, tuple[float, torch.Tensor]] = {}  # slot -> (penalty, delivered token ids)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        owed = delivered(sampling_params)
        if owed is None:
            self.rows.pop(req_idx, None)  # a slot is reused: its last occupant's state goes
            return False
        self.rows[req_idx] = (owed.penalty, torch.tensor(owed.tokens, dtype=torch.long, device=self.state.device))
        return True

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        if not self.rows:
            return logits
        slots = ctx.idx_mapping_np.tolist()
        token_ids = _on_device(self.state.all_token_ids)
        ends = _on_device(self.state.total_len)
        for slot, (penalty, tokens) in list(self.rows.items()):
            if slot not in slots:
                continue  # not in this step's batch; a finished request's slot is reset by its next add_request
            start = int(self.state.prompt_len.np[slot])
            bound = int(ctx.seq_lens_upper_bound_np[slots.index(slot)])
            generated = token_ids[slot, start:max(start, bound)]
            positions = torch.arange(start, start + generated.numel(), device=generated.device)
            committed = positions < ends[slot]
            regenerated = ((generated.unsqueeze(0) == tokens.unsqueeze(1)) & committed).any(dim=1)
            rows = (ctx.expanded_idx_mapping == slot).to(logits.dtype)
            logits[:, tokens] -= penalty * rows.unsqueeze(1) * (~regenerated).to(logits.dtype).unsqueeze(0)
        return logits
