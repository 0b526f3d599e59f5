"""The KV caches (worker/own/cache.py): the roomy one holds the same contents as transformers' concatenating layer,
through the engine's own edits of a batch, with decode steps written in place; the ragged one holds each
row's own tokens, unpadded, through joins and leaves that copy nothing but the newcomer."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer

from worker.own.cache import ROOM, RoomyLayer, block, join, new_cache, row_cache, select_rows, stacked_cache


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


def ragged(layers: int = 1):
    return new_cache(LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4), ragged=True)


def forward(cache, keys: torch.Tensor, values: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What one forward does to the cache: every layer writes the same new tokens."""
    return [cache.layers[i].update(keys, values) for i in range(len(cache.layers))][-1]


def test_a_ragged_cache_holds_each_row_s_own_tokens_through_joins_and_leaves() -> None:
    torch.manual_seed(1)
    cache, expected = ragged(layers=2), []

    def check(got: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        """Every row as expected (in the last layer), and what the last forward returned too."""
        rows = [cache.layers[1].row(r) for r in range(len(expected))]
        assert [k.shape[2] for k, _ in rows] == [k.shape[2] for k, _ in expected]
        assert all(torch.equal(a, b) for row, want in zip(rows, expected, strict=True)
                   for a, b in zip(row, want, strict=True))
        if got is not None:
            assert all(torch.equal(a, b[0]) for a, b in zip(got[0], expected, strict=True))

    keys, values = step(3, tokens=5)  # a prefill of three rows
    got = forward(cache, keys, values)
    expected = [(keys[r:r + 1], values[r:r + 1]) for r in range(3)]
    check(got)
    assert cache.get_seq_length() == 5
    for _ in range(ROOM + 3):  # decode steps across a growth
        keys, values = step(3)
        got = forward(cache, keys, values)
        expected = [(torch.cat([k, keys[r:r + 1]], 2), torch.cat([v, values[r:r + 1]], 2))
                    for r, (k, v) in enumerate(expected)]
        check(got)
    select_rows(cache, [2, 0])  # a row leaves: no copy of the others
    expected = [expected[2], expected[0]]
    check()
    long = ragged(layers=2)
    long_keys, long_values = step(1, tokens=300)
    forward(long, long_keys, long_values)
    join(cache, long, width=0)  # a long row joins: the others are not padded to its length
    expected.append((long_keys, long_values))
    check()
    keys, values = step(3)
    got = forward(cache, keys, values)
    expected = [(torch.cat([k, keys[r:r + 1]], 2), torch.cat([v, values[r:r + 1]], 2))
                for r, (k, v) in enumerate(expected)]
    check(got)
    assert cache.get_seq_length() == 301


def test_ragged_rows_join_and_leave_without_a_copy_and_outgrow_their_room_alone() -> None:
    cache = ragged()
    forward(cache, *step(4, tokens=10))
    buffers = list(cache.layers[0].key_buffers)
    select_rows(cache, [0, 1, 3])
    forward(cache, *step(3))
    assert cache.layers[0].key_buffers == [buffers[0], buffers[1], buffers[3]]  # written in place, none moved
    newcomer = ragged()
    forward(newcomer, *step(1, tokens=300))  # longer than the others' room
    join(cache, newcomer, width=0)
    before = list(cache.layers[0].key_buffers)
    assert before[3] is newcomer.layers[0].key_buffers[0]
    for _ in range(ROOM):
        forward(cache, *step(4))
    after = cache.layers[0].key_buffers
    assert [a is not b for a, b in zip(after, before, strict=True)] == [True, True, True, False]  # each on its own
    assert after[0].shape[2] >= 2 * ROOM


def test_a_row_cut_from_a_ragged_cache_keeps_its_buffers_and_block_copies_columns() -> None:
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)
    cache = ragged()
    keys, values = step(2, tokens=12)
    forward(cache, keys, values)
    alone = row_cache(config, cache, row=1, length=9)  # the padding after a prompt's end cut off
    assert alone.layers[0].key_buffers[0] is cache.layers[0].key_buffers[1]
    assert torch.equal(alone.layers[0].row(0)[0], keys[1:2, :, :9])
    more = step(1)
    got = forward(alone, *more)  # continues in place, over the cut-off columns
    assert torch.equal(got[0][0], torch.cat([keys[1:2, :, :9], more[0]], 2))
    piece = block(cache, 0, 4, 8)
    assert piece.shape == (1, 2, 3, 4, 8) and torch.equal(piece[0, 1], values[0, :, 4:8])
    restored = stacked_cache(config, [[block(cache, 0, 0, 4), block(cache, 0, 4, 8)], [block(cache, 1, 0, 8)]],
                             ragged=True)
    assert torch.equal(restored.layers[0].row(1)[0], keys[1:2, :, :8])
    assert torch.equal(restored.layers[0].row(0)[1], values[0:1, :, :8])  # a row's blocks joined in order
