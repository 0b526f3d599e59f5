"""A KV cache whose layers keep room after their tokens.

transformers' `DynamicLayer` concatenates each new token onto its keys and values, which copies the
whole cache of every layer at every decode step: at 16 rows that is several milliseconds at 100 tokens,
and it grows with the context until it costs more than the step's arithmetic. Here a layer's keys and
values are views into buffers with spare columns, so a step writes one column in place; a buffer is
replaced by a larger one only every `ROOM` tokens. The engine may still index, pad or slice `keys` and
`values` (a finished row leaving, newcomers joining): whatever tensor it sets, room is read off its
strides, and a tensor without room is simply copied into a roomier buffer on the next update.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer

ROOM = 128  # columns added at each growth: a copy every 128 tokens, at most 128 unused columns per layer


class RoomyLayer(DynamicLayer):
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = _append(self.keys, key_states), _append(self.values, value_states)
        return self.keys, self.values


def _append(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`cached` with `new` after it along the token axis (2), written into spare room when there is some."""
    if cached.numel() == 0:
        return _in_buffer(new)
    batch, heads, length, dim = cached.shape
    added = new.shape[2]
    row_stride = cached.stride(1)
    start = cached.storage_offset() % row_stride // dim if row_stride else 0
    laid_out = cached.stride() == (heads * row_stride, row_stride, dim, 1) and cached.storage_offset() < row_stride
    if not laid_out or start + length + added > row_stride // dim:
        return _in_buffer(torch.cat([cached, new], dim=2))
    grown = cached.as_strided((batch, heads, length + added, dim), cached.stride())
    grown[:, :, length:] = new
    return grown


def _in_buffer(tensor: torch.Tensor) -> torch.Tensor:
    batch, heads, length, dim = tensor.shape
    buffer = tensor.new_empty((batch, heads, length + ROOM, dim))
    buffer[:, :, :length] = tensor
    return buffer[:, :, :length]


def new_cache(config: PreTrainedConfig) -> DynamicCache:
    """transformers' cache for `config`, its plain full-attention layers replaced by roomy ones."""
    cache = DynamicCache(config=config)
    cache.layers = [RoomyLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
