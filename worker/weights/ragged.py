"""The ragged KV cache of the int8 Llama and the GGUF blocks, whose attention reads each row's own keys: each
row has buffers of its own with room, and its own length; a forward writes every row's new tokens with one call,
and attention gets each row's own keys and values (views, no padding). Rows join and leave without any copy; a
row that outgrows its room is copied alone, into twice the room. It lives beside the kernels that attend over
it (native.cpp, blocks.cpp); worker/own/cache.py makes and reshapes caches of it for the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicLayer

from worker.weights import native, scripted

ROOM = 128  # columns added at each growth: a copy every 128 tokens, at most 128 unused columns per layer


@dataclass
class Rows:
    """The rows of a ragged cache, shared by its layers: row i holds `lengths[i]` tokens. A forward's tokens
    are committed to `lengths` once its last layer has written them. `capacity`: the tokens a new row's
    buffers have room for (a prefill knows its prompts' lengths; more room is added when needed)."""

    layers: int
    lengths: list[int] = field(default_factory=list)
    capacity: int = ROOM
    written: int = 0  # layers that have written the current forward's tokens

    def keep(self, rows: list[int]) -> None:
        self.lengths = [self.lengths[r] for r in rows]


class RaggedLayer(DynamicLayer):
    def __init__(self, rows: Rows) -> None:
        super().__init__()
        self.rows = rows
        # Row r's keys and values: buffers [1, heads, capacity, head_dim], of which lengths[r] tokens are real.
        self.key_buffers: list[torch.Tensor] = []
        self.value_buffers: list[torch.Tensor] = []

    def get_seq_length(self) -> int:
        return max(self.rows.lengths, default=0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict | None = None,
               *args: object, **kwargs: object) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Write each row's new tokens after its own; returns each row's keys and values, [1, heads, n, dim].
        `cache_kwargs` {"native": True}: by worker/weights/native.cpp's write_rows (the same copies, in one call)."""
        self._make_room(key_states, value_states)
        compiled = bool(cache_kwargs and cache_kwargs.get("native"))
        write = native.ops.write_rows if compiled else scripted.write_rows
        written = write(self.key_buffers, self.value_buffers, self.rows.lengths, key_states, value_states)
        self._commit(key_states.shape[2])
        return written

    def write_and_attend(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """A forward's update and row-wise causal attention in one call of worker/weights/native.cpp ([rows, heads, t,
        dim] each in, [rows, t, heads, dim] out), without a view of every row's keys and values in every layer.
        A decode step (t = 1): the same numbers as update() and then decode_attention over the rows it returns."""
        return self.attend_with(key_states, lambda keys, values, lengths: native.ops.write_and_attend(
            query, keys, values, lengths, key_states, value_states, scaling))

    def attend_with(self, shape: torch.Tensor,
                    call: Callable[[list[torch.Tensor], list[torch.Tensor], list[int]], torch.Tensor]) -> torch.Tensor:
        """A compiled layer that writes the forward's keys and values itself and attends (worker/weights/blocks.cpp's
        block_layer), over every row's buffers and lengths: room first for `shape`'s tokens ([rows, heads, t,
        dim], of which only the shape and type are read), the tokens committed after."""
        return attend_layers([self], shape, call)

    def _make_room(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers for a fresh cache's rows, and every row's room for the new tokens."""
        rows, added = self.rows, key_states.shape[2]
        if not rows.lengths:  # a fresh cache: one row per batch row
            rows.lengths = [0] * key_states.shape[0]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.key_buffers:
            room = max(rows.capacity, added + ROOM)
            self.key_buffers = [key_states.new_empty((1, *key_states.shape[1:2], room, key_states.shape[3]))
                                for _ in rows.lengths]
            self.value_buffers = [buffer.new_empty(buffer.shape) for buffer in self.key_buffers]
        for row, length in enumerate(rows.lengths):
            if length + added > self.key_buffers[row].shape[2]:
                self._grow(row, length, length + added)

    def _commit(self, added: int) -> None:
        """The rows' lengths take the forward's tokens once its last layer has written them."""
        rows = self.rows
        rows.written += 1
        if rows.written == rows.layers:
            rows.lengths, rows.written = [length + added for length in rows.lengths], 0

    def _grow(self, row: int, length: int, needed: int) -> None:
        """A larger buffer for one row (twice the room: a row is copied a few times over its life, at most)."""
        for buffers in (self.key_buffers, self.value_buffers):
            old = buffers[row]
            buffers[row] = old.new_empty((*old.shape[:2], max(needed + ROOM, 2 * old.shape[2]), old.shape[3]))
            buffers[row][:, :, :length] = old[:, :, :length]

    def row(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.rows.lengths[row]
        return self.key_buffers[row].narrow(2, 0, length), self.value_buffers[row].narrow(2, 0, length)


def attend_layers(layers: list[RaggedLayer], shape: torch.Tensor,
                  call: Callable[[list[torch.Tensor], list[torch.Tensor], list[int]], torch.Tensor]) -> torch.Tensor:
    """`RaggedLayer.attend_with` for several layers of one cache in one call (worker/weights/blocks.cpp's
    block_layers): every layer's buffers, layer after layer, each row's in order; the rows' lengths are shared."""
    for layer in layers:
        layer._make_room(shape, shape)
    out = call([buffer for layer in layers for buffer in layer.key_buffers],
               [buffer for layer in layers for buffer in layer.value_buffers], layers[0].rows.lengths)
    for layer in layers:
        layer._commit(shape.shape[2])
    return out
