"""KV caches for the engine: rows in one padded tensor with room (`RoomyLayer`, any model), or rows side by side
without padding (`RaggedLayer`, worker/weights/ragged.py beside the kernels that attend over it: the int8 Llama,
whose attention reads each row's own keys, each row with buffers of its own, with room, and its own length).

transformers' `DynamicLayer` concatenates each new token onto its keys and values, copying the whole cache of
every layer at every decode step; a layer with room writes one column in place. The functions after the layer
are what the engine does to a cache of either kind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer

from worker.weights import native
from worker.weights.ragged import ROOM, RaggedLayer, Rows


class RoomyLayer(DynamicLayer):
    """A layer whose keys and values are views into buffers with spare columns, so a step writes one column in
    place; a buffer is replaced by a larger one only every `ROOM` tokens. transformers' `DynamicLayer` instead
    concatenates: at 16 rows that is several milliseconds at 100 tokens, and it grows with the context until it
    costs more than the step's arithmetic.

    The engine may still index, pad or slice `keys` and `values` (a finished row leaving, newcomers joining):
    whatever tensor it sets, room is read off its strides, and a tensor without room is simply copied into a
    roomier buffer on the next update. Rows of a batch are left-padded to the longest: a 2,000-token newcomer
    pads every other row to 2,000."""

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


def pad_left(tensor: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """`tensor` with zero columns before its entries along `dim`, up to `width`."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - dim - 1) + [missing, 0]
    return F.pad(tensor, pad)


def new_cache(config: PreTrainedConfig, ragged: bool = False, capacity: int = 0) -> DynamicCache:
    """transformers' cache for `config`, its plain full-attention layers replaced by roomy ones, or all of
    them by ragged ones (only for models whose attention takes rows one by one: worker/weights/quant.py), whose rows
    get room for `capacity` tokens at first."""
    cache = DynamicCache(config=config)
    if ragged:
        rows = Rows(len(cache.layers), capacity=max(capacity, ROOM))
        cache.layers = [RaggedLayer(rows) for _ in cache.layers]
    else:
        cache.layers = [RoomyLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def is_ragged(cache: DynamicCache) -> bool:
    return isinstance(cache.layers[0], RaggedLayer)


def all_plain(cache: DynamicCache) -> bool:
    """Whether every layer keeps plain keys and values of all tokens (no sliding window, no other state):
    then a block's keys and values can be cut out and put back (the prefix cache)."""
    return all(type(layer) in (RoomyLayer, RaggedLayer) for layer in cache.layers)


def select_rows(cache: DynamicCache, rows: list[int]) -> None:
    """Keep these rows, in this order."""
    if is_ragged(cache):
        cache.layers[0].rows.keep(rows)
        for layer in cache.layers:
            layer.key_buffers = [layer.key_buffers[r] for r in rows]
            layer.value_buffers = [layer.value_buffers[r] for r in rows]
        return
    index = torch.tensor(rows, dtype=torch.long, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[index], layer.values[index]


def trim_left(cache: DynamicCache, start: int) -> None:
    """Drop the first `start` columns of every row: padding (a ragged cache has none)."""
    if not is_ragged(cache):
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]


def join(cache: DynamicCache, other: DynamicCache, width: int) -> None:
    """`other`'s rows after `cache`'s (a padded cache: both left-padded to `width` columns; a ragged one takes
    over `other`'s buffers, which `other` must no longer use)."""
    if not is_ragged(cache):
        for mine, theirs in zip(cache.layers, other.layers, strict=True):
            mine.keys = torch.cat([pad_left(mine.keys, width, dim=2), pad_left(theirs.keys, width, dim=2)])
            mine.values = torch.cat([pad_left(mine.values, width, dim=2), pad_left(theirs.values, width, dim=2)])
        return
    cache.layers[0].rows.lengths += other.layers[0].rows.lengths
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        mine.key_buffers += theirs.key_buffers
        mine.value_buffers += theirs.value_buffers
        if not mine.is_initialized:
            mine.lazy_initialization(theirs.key_buffers[0], theirs.value_buffers[0])


def row_cache(config: PreTrainedConfig, cache: DynamicCache, row: int, length: int) -> DynamicCache:
    """A cache of row `row`'s first `length` tokens alone (the padding after a prompt's end cut off): the
    very buffers of a ragged cache, which the caller must no longer use; a copy of a padded one."""
    if not is_ragged(cache):
        return filled_cache(config, [(layer.keys[row:row + 1, :, :length], layer.values[row:row + 1, :, :length])
                                     for layer in cache.layers])
    alone = new_cache(config, ragged=True)
    alone.layers[0].rows.lengths = [length]
    for mine, theirs in zip(alone.layers, cache.layers, strict=True):
        mine.key_buffers, mine.value_buffers = [theirs.key_buffers[row]], [theirs.value_buffers[row]]
        mine.lazy_initialization(theirs.key_buffers[row], theirs.value_buffers[row])
    return alone


def block(cache: DynamicCache, row: int, start: int, stop: int) -> torch.Tensor:
    """Columns start..stop of one row, every layer: [layers, 2 (keys, values), heads, stop - start, dim], a copy."""
    pairs = [layer.row(row) if isinstance(layer, RaggedLayer) else (layer.keys[row:row + 1], layer.values[row:row + 1])
             for layer in cache.layers]
    return torch.stack([torch.stack((keys[0, :, start:stop], values[0, :, start:stop])) for keys, values in pairs])


def filled_cache(config: PreTrainedConfig, keys_values: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A roomy cache holding these (keys, values) per layer, copied into buffers with room."""
    cache = new_cache(config)
    for layer, (keys, values) in zip(cache.layers, keys_values, strict=True):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = _in_buffer(keys), _in_buffer(values)
    return cache


def stacked_cache(config: PreTrainedConfig, rows: list[list[torch.Tensor]], ragged: bool,
                  capacity: int = 0) -> DynamicCache:
    """A cache whose row r holds the blocks `rows[r]` one after another (each block [layers, 2 (keys, values),
    heads, tokens, head_dim]; every row as long), with room for `capacity` tokens per row. The blocks are copied
    straight into each layer's buffers (float32 on the CPU: worker/weights/native.cpp's join_blocks, when loaded) or
    joined layer by layer: a join of the whole row at once would take a fresh allocation of the row's every
    layer, whose first touch costs more than the copies."""
    cache = new_cache(config, ragged, capacity)
    _, _, heads, _, dim = rows[0][0].shape
    length = sum(block.shape[3] for block in rows[0])
    room = max(capacity, length + ROOM)
    if ragged:
        cache.layers[0].rows.lengths = [length] * len(rows)
    stacks = [tuple(rows[0][0].new_empty((len(rows), heads, room, dim)) for _ in range(2)) for _ in cache.layers]
    compiled = native.loaded() and rows[0][0].dtype == torch.float32 and rows[0][0].device.type == "cpu"
    for row, blocks in enumerate(rows):
        if compiled:  # the same copies in one call, the layers on all threads
            native.ops.join_blocks(blocks, [keys for keys, _ in stacks], [values for _, values in stacks], row)
            continue
        for index, (keys, values) in enumerate(stacks):
            joined = torch.cat([block[index] for block in blocks], dim=2)
            keys[row, :, :length], values[row, :, :length] = joined[0], joined[1]
    for layer, (keys, values) in zip(cache.layers, stacks, strict=True):
        layer.lazy_initialization(keys, values)
        if ragged:  # each row its own buffer: a view of one row of the stack
            layer.key_buffers, layer.value_buffers = list(keys.split(1)), list(values.split(1))
        else:
            layer.keys, layer.values = keys[:, :, :length], values[:, :, :length]
    return cache
