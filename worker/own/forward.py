"""The int8 Llama's forward (worker/weights/quant.py) over several parts in one pass, run by the engine itself.

A part is one forward's worth of tokens: the running batch's decode step ([rows, 1]) or a block of a prefill
group ([rows, block]), each over its own cache. Every int8 call takes the rows of all parts side by side, so a
decode step that carries a prefill block reads each layer's weights once instead of twice. The kernels compute
rows independently and each part attends over its own keys only: each part's logits are those its own forward
gives, bit for bit (tested against transformers' forward; the costs: docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from worker.weights.quant import rotary_factors


@dataclass
class Part:
    ids: torch.Tensor  # [rows, length]
    positions: torch.Tensor  # [rows, length]
    cache: DynamicCache  # ragged (worker/own/cache.py): rows side by side, every row `depth` tokens before these
    depth: int = 0
    last: torch.Tensor | None = None  # [rows]: which token's logits each row wants (None: its last)


def causal_mask(part: Part) -> torch.Tensor | None:
    """What row-wise attention needs of a block after `depth` cached tokens: token i sees keys 0..depth+i. A
    decode step's token sees every key, and a first block is plainly causal: neither needs a mask."""
    rows, length = part.ids.shape
    if length == 1 or part.depth == 0:
        return None
    allowed = torch.ones(length, part.depth + length, dtype=torch.bool, device=part.ids.device).tril(part.depth)
    return allowed.expand(rows, 1, length, part.depth + length)


def forward_parts(model: PreTrainedModel, parts: list[Part]) -> list[torch.Tensor]:
    """Each part's logits, [rows, vocab], of the token `last` picks in each row."""
    inner = model.model
    hidden = [inner.embed_tokens(part.ids) for part in parts]
    rope = [rotary_factors(*inner.rotary_emb(h, part.positions)) for h, part in zip(hidden, parts, strict=True)]
    masks = [causal_mask(part) for part in parts]
    caches = [part.cache for part in parts]
    layers = inner.layers
    hidden = type(layers[0]).forward_stack(layers, hidden, rope, masks, caches)
    picked = [h[:, -1] if part.last is None else h[torch.arange(len(h), device=h.device), part.last]
              for h, part in zip(hidden, parts, strict=True)]
    rows = [len(p) for p in picked]
    logits = model.lm_head(inner.norm(picked[0] if len(picked) == 1 else torch.cat(picked)))
    return list(logits.split(rows))
