"""The roomy KV cache (worker/cache.py): same contents as transformers' concatenating layer, through the
engine's own edits of a batch, with decode steps written in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer

from worker.cache import ROOM, RoomyLayer, new_cache


def step(batch: int, tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, tokens, 8), torch.randn(batch, 3, tokens, 8)


def test_contents_match_concatenation_through_selects_trims_and_joins() -> None:
    torch.manual_seed(0)
    roomy, plain = RoomyLayer(), DynamicLayer()

    def update(keys: torch.Tensor, values: torch.Tensor) -> None:
        got, expected = roomy.update(keys, values), plain.update(keys, values)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    def edit(change: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """What the engine does to a batch's layers between steps."""
        for layer in (roomy, plain):
            layer.keys, layer.values = change(layer.keys), change(layer.values)

    update(*step(4, tokens=5))  # a prefill
    for _ in range(ROOM + 7):  # across a growth
        update(*step(4))
    edit(lambda t: t[torch.tensor([0, 2, 3])])  # a row leaves
    for _ in range(3):
        update(*step(3))
    edit(lambda t: t[:, :, 2:])  # leading padding trimmed
    for _ in range(3):
        update(*step(3))
    newcomers = torch.randn(2, 3, 4, 8)
    edit(lambda t: torch.cat([t, F.pad(newcomers, [0, 0, t.shape[2] - 4, 0])]))  # two rows join, left-padded
    for _ in range(3):
        update(*step(5))


def test_a_decode_step_writes_in_place_until_the_room_is_used() -> None:
    layer = RoomyLayer()
    layer.update(*step(2, tokens=10))
    buffer = layer.keys.data_ptr()
    for _ in range(ROOM):
        layer.update(*step(2))
        assert layer.keys.data_ptr() == buffer
    layer.update(*step(2))
    assert layer.keys.data_ptr() != buffer and layer.keys.shape[2] == 10 + ROOM + 1


def test_new_cache_has_a_roomy_layer_per_decoder_layer() -> None:
    cache = new_cache(LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4))
    assert [type(layer) for layer in cache.layers] == [RoomyLayer] * 3
