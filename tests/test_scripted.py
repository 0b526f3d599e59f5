"""worker/weights/scripted.py: each TorchScript function gives its plain Python's bits, on every call (the profiling
executor changes its graph after the first calls) and at every shape the worker uses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.own.forward import Part, causal_mask
from worker.weights import scripted
from worker.weights.quant import Int8Linear
from worker.weights.rotation import hadamard

CALLS = 5  # past the executor's profiling runs


def same_every_call(name: str, *args: object) -> None:
    plain, script = scripted.PLAIN[name], getattr(scripted, name)
    for _ in range(CALLS):
        expected, got = plain(*args), script(*args)
        pairs = zip(expected, got, strict=True) if isinstance(expected, tuple) else [(expected, got)]
        for want, have in pairs:
            assert have.dtype == want.dtype and torch.equal(have, want), name


def packed(in_features: int, out_features: int) -> object:
    return Int8Linear(nn.Linear(in_features, out_features, bias=False)).packed


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_int8_products_norms_and_rotary_heads_are_eager_s_bits(rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 576) * torch.logspace(-2, 2, rows)[:, None]
    weights, bias, gain = packed(576, 960), torch.randn(960), torch.rand(576) + 0.5
    same_every_call("int8_linear", x, weights, None, None)
    same_every_call("int8_linear", x, weights, bias, 1e-5)
    same_every_call("int8_linear", x.bfloat16(), weights, None, None)
    same_every_call("normed_linear", x, weights, None, 1e-5)
    same_every_call("normed_linear", x, weights, gain, 1e-5)
    length = 4
    qkv = torch.randn(rows * length, 15 * 64)
    cos, signed_sin = torch.randn(rows, 1, length, 64), torch.randn(rows, 1, length, 64)
    same_every_call("heads", qkv, rows, length, 64, 9, 3, cos, signed_sin)


@pytest.mark.parametrize("length,depth", [(1, 40), (16, 0), (16, 32)])  # a decode step, a first block, a block
def test_attention_over_each_row_s_own_keys_is_eager_s_bits(length: int, depth: int) -> None:
    torch.manual_seed(length + depth)
    rows = 3
    query = torch.randn(rows, 9, length, 64)
    extras = (0, 7, 2) if length == 1 else (0, 0, 0)  # a decode step's rows may hold different lengths
    keys = [torch.randn(1, 3, depth + length + extra, 64) for extra in extras]
    values = [torch.randn_like(k) for k in keys]
    ids = torch.zeros(rows, length, dtype=torch.long)
    mask = causal_mask(Part(ids, ids, None, depth=depth))
    same_every_call("attend_rows", query, keys, values, mask, 0.125)
    # the padded batch's form: rows of `n` real tokens, the last n of wider keys
    wide = torch.randn(rows, 3, depth + length + 5, 64)
    same_every_call("attend", query, wide, torch.randn_like(wide), mask, 0, depth + length, 0.125)


@pytest.mark.parametrize("rows", [1, 16])
def test_the_mlp_and_its_rotation_are_eager_s_bits(rows: int) -> None:
    torch.manual_seed(rows)
    x, attended = torch.randn(rows, 576), torch.randn(rows, 576)
    weights = packed(576, 576), packed(576, 2 * 1536), packed(1536, 576)
    block = hadamard(128).float()
    same_every_call("rotate_blocks", torch.randn(rows, 1536), block)
    same_every_call("mlp_residual", x, attended, *weights, None, 1e-5, block)
    same_every_call("mlp_residual", x, attended, *weights, torch.rand(576) + 0.5, 1e-5, None)


@pytest.mark.parametrize("added", [1, 16])
def test_rows_written_into_their_buffers_are_eager_s_and_land_in_place(added: int) -> None:
    torch.manual_seed(added)
    lengths, keys, values = [3, 40, 0], torch.randn(3, 3, added, 64), torch.randn(3, 3, added, 64)
    made = []
    for function in (scripted.PLAIN["write_rows"], scripted.write_rows):
        for _ in range(CALLS):
            key_buffers = [torch.zeros(1, 3, 64, 64) for _ in lengths]
            value_buffers = [torch.zeros(1, 3, 64, 64) for _ in lengths]
            row_keys, row_values = function(key_buffers, value_buffers, lengths, keys, values)
        made.append((key_buffers, value_buffers, row_keys, row_values))
        for row, length in enumerate(lengths):
            assert row_keys[row].data_ptr() == key_buffers[row].data_ptr()  # views of the buffers, no copy
            assert torch.equal(row_keys[row][:, :, length:], keys[row:row + 1])
            assert torch.equal(row_values[row][:, :, length:], values[row:row + 1])
            assert not key_buffers[row][:, :, length + added:].any()  # nothing past the new tokens
    for plain, script in zip(*made, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(plain, script, strict=True))
