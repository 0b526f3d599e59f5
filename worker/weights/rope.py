"""The rotary embedding a GGUF file asks for, where transformers' GGUF loader drops it.

llama.cpp's converter writes Llama 3's `llama3` rotary scaling (Llama 3.1, 3.2, 3.3) as a tensor, `rope_freqs.weight`:
one divisor per rotary frequency (head_dim / 2 of them). transformers builds the config from the file's metadata
only, so it loads such a file with the default rotary embedding: every frequency the scaling slows down turns too
fast, and the model's attention drifts from llama.cpp's with the distance between tokens. `take_file_factors` divides
the loaded model's frequencies by the file's divisors, which is llama.cpp's arithmetic (and, for the `llama3` type,
the frequencies transformers computes from an HF config).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from worker.weights.blocks import FileTensor

FACTORS = "rope_freqs.weight"


def take_file_factors(model: nn.Module, tensors: dict[str, FileTensor]) -> bool:
    """Divide the model's rotary frequencies by the file's `rope_freqs` (when it has them and the model was loaded
    with the default type, which is what transformers makes of such a file); returns whether it did."""
    factors = tensors.get(FACTORS)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if factors is None or rotary is None or getattr(rotary, "rope_type", None) != "default":
        return False
    divisors = torch.from_numpy(np.ascontiguousarray(factors.data).view(np.float32).reshape(-1).copy())
    if divisors.numel() != rotary.inv_freq.numel():
        raise ValueError(f"{FACTORS} has {divisors.numel()} factors for {rotary.inv_freq.numel()} frequencies")
    scaled = rotary.inv_freq.float() / divisors.to(rotary.inv_freq.device)
    rotary.inv_freq = scaled.to(rotary.inv_freq.dtype)
    rotary.original_inv_freq = rotary.inv_freq.clone()
    return True
