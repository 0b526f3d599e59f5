"""worker/weights/native.cpp, through native.py: the int8 product, the rotary heads and the cache writes give the
TorchScript layer's bits (the product with a norm folded in, to rounding); the decode attention and the MLP
agree with it to float rounding, and a row's result does not depend on its batch-mates;
the setting's modes and a failed build behave as documented."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from common.settings import Settings, SettingsError
from tests.conftest import native_kernels
from worker.own.cache import new_cache
from worker.own.forward import Part, forward_parts
from worker.own.model import LoadedModel
from worker.weights import native, scripted
from worker.weights.quant import Int8Linear, Int8LlamaLayer, use_native
from worker.weights.rotation import InputRotation

native_kernels()
ops = torch.ops.llmserve
THREADS = torch.get_num_threads()


def linear(in_features: int, out_features: int, bias: bool = False) -> Int8Linear:
    return Int8Linear(nn.Linear(in_features, out_features, bias=bias), native=True)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_int8_product_is_the_scripted_one(rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 576) * torch.logspace(-2, 2, rows)[:, None]
    layer = linear(576, 960, bias=True)
    for bias in (None, layer.bias):
        want = scripted.PLAIN["int8_linear"](x, layer.packed, bias, None)
        assert torch.equal(ops.int8_linear(x, layer.weight, bias, None), want)
        # RMSNorm folded in: only the row's output scale takes the norm, whose sum of squares is the loop's
        want = scripted.PLAIN["int8_linear"](x, layer.packed, bias, 1e-5)
        torch.testing.assert_close(ops.int8_linear(x, layer.weight, bias, 1e-5), want, rtol=2e-6, atol=1e-6)
    want = scripted.int8_linear(x, layer.packed, layer.bias, None)
    assert torch.equal(layer(x.view(1, rows, 576)), want.view(1, rows, -1))  # the lm_head's call, any leading shape


def test_the_kernels_know_a_layer_s_weights_by_number_until_the_layer_goes() -> None:
    layer = linear(64, 32)
    x = torch.randn(2, 64)
    number = layer.weight
    assert isinstance(number, int) and layer.weight == number  # given once
    assert torch.equal(ops.int8_linear(x, number, None, None), scripted.int8_linear(x, layer.packed, None, None))
    assert linear(64, 32).weight != number
    twin = copy.deepcopy(layer)
    del layer
    gc.collect()
    assert twin.weight != number  # its own, alive after the original's went
    assert torch.equal(twin(x), scripted.int8_linear(x, twin.packed, None, None))
    with pytest.raises(RuntimeError, match=f"no int8 weight number {number}"):
        ops.int8_linear(x, number, None, None)
    for wrong in (-1, 1 << 40):
        with pytest.raises(RuntimeError, match="no int8 weight number"):
            ops.int8_linear(x, wrong, None, None)


@pytest.mark.parametrize("rows,length", [(1, 1), (3, 1), (2, 16)])
def test_the_rotary_heads_and_the_cache_writes_are_the_scripted_ones_bit_for_bit(rows: int, length: int) -> None:
    torch.manual_seed(rows * length)
    qkv = torch.randn(rows * length, 15 * 64)
    cos, signed_sin = torch.randn(rows, 1, length, 64), torch.randn(rows, 1, length, 64)
    got = ops.heads(qkv, rows, length, 64, 9, 3, cos, signed_sin)
    want = scripted.PLAIN["heads"](qkv, rows, length, 64, 9, 3, cos, signed_sin)
    for have, expected in zip(got, want, strict=True):
        assert have.shape == expected.shape and torch.equal(have, expected)
    lengths = [5 * r for r in range(rows)]
    buffers = {"scripted": [torch.randn(1, 3, 40, 64) for _ in range(rows)]}
    values = {"scripted": [torch.randn(1, 3, 40, 64) for _ in range(rows)]}
    buffers["native"] = [b.clone() for b in buffers["scripted"]]
    values["native"] = [v.clone() for v in values["scripted"]]
    _, key, value = want  # the value heads: a strided view of qkv, as the layer passes them
    mine = ops.write_rows(buffers["native"], values["native"], lengths, key, value)
    theirs = scripted.PLAIN["write_rows"](buffers["scripted"], values["scripted"], lengths, key, value)
    for side in range(2):
        for have, expected in zip(mine[side], theirs[side], strict=True):
            assert torch.equal(have, expected)
    for have, expected in zip(buffers["native"] + values["native"], buffers["scripted"] + values["scripted"],
                              strict=True):
        assert torch.equal(have, expected)  # in place, and nothing else touched
    assert mine[0][0].data_ptr() == buffers["native"][0].data_ptr()
    with pytest.raises(RuntimeError, match="no room"):
        ops.write_rows(buffers["native"], values["native"], [40 - length + 1] * rows, key, value)


def keys_and_values(lengths: list[int], room: int = 40) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Views of buffers with room, as a ragged cache holds them."""
    keys = [torch.randn(1, 3, n + room, 64).narrow(2, 0, n) for n in lengths]
    return keys, [torch.randn_like(k.contiguous()) for k in keys]


def test_decode_attention_is_sdpa_s_to_rounding_and_each_row_its_own() -> None:
    torch.manual_seed(0)
    lengths = [1, 5, 70, 256, 257, 900]  # one run of keys; a long row's keys in runs shared among the threads
    query = torch.randn(len(lengths), 9, 1, 64)
    keys, values = keys_and_values(lengths)
    got = ops.decode_attention(query, keys, values, 0.125)
    want = scripted.PLAIN["attend_rows"](query, keys, values, None, 0.125)
    assert got.shape == want.shape == (len(lengths), 1, 9, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for row in range(len(lengths)):  # alone, or with other batch-mates: the same bits
        alone = ops.decode_attention(query[row:row + 1], keys[row:row + 1], values[row:row + 1], 0.125)
        assert torch.equal(alone, got[row:row + 1])
    shuffled = [3, 0, 5, 1]
    mixed = ops.decode_attention(query[shuffled], [keys[r] for r in shuffled], [values[r] for r in shuffled], 0.125)
    assert torch.equal(mixed, got[shuffled])
    torch.set_num_threads(1)  # the runs of a long row on one thread: the same bits
    try:
        assert torch.equal(ops.decode_attention(query, keys, values, 0.125), got)
    finally:
        torch.set_num_threads(THREADS)


def test_decode_attention_is_sdpa_s_to_rounding_at_every_instruction_set_level() -> None:
    """A decode step's kernel in vectors of 16 or 8 (WORKER_ISA's levels) and in plain loops: each SDPA's to
    rounding, and row by row the same bits alone as in the batch."""
    torch.manual_seed(4)
    lengths = [1, 3, 4, 7, 64, 300]  # whole runs of four keys and the rest
    query = torch.randn(len(lengths), 9, 1, 64)
    keys, values = keys_and_values(lengths)
    want = scripted.PLAIN["attend_rows"](query, keys, values, None, 0.125)
    try:
        for level in sorted({ops.attention_isa(level) for level in (0, 1, 2)}):
            assert ops.attention_isa(level) == level
            got = ops.decode_attention(query, keys, values, 0.125)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            alone = ops.decode_attention(query[4:5], keys[4:5], values[4:5], 0.125)
            assert torch.equal(alone, got[4:5]), f"instruction set {level}"
    finally:
        ops.attention_isa(2)


@pytest.mark.parametrize("length", [16, 5])
def test_a_block_s_attention_is_causal_sdpa_s_to_rounding_and_each_row_its_own(length: int) -> None:
    """Several new tokens per row (a prefill block after the row's cached tokens): token i sees the cache and
    the block up to i."""
    torch.manual_seed(2)
    lengths = [0, 16, 240, 256, 500, 1000]  # a first block; blocks whose keys end inside or past a run
    rows = len(lengths)
    query, keys, values = (torch.randn(rows, heads, length, 64) for heads in (9, 3, 3))
    buffers = [torch.randn(1, 3, 1040, 64) for _ in range(rows)], [torch.randn(1, 3, 1040, 64) for _ in range(rows)]
    copies = [b.clone() for b in buffers[0]], [b.clone() for b in buffers[1]]
    got = ops.write_and_attend(query, *buffers, lengths, keys, values, 0.125)
    assert got.shape == (rows, length, 9, 64)
    for row, cached in enumerate(lengths):
        n = cached + length
        sees = torch.ones(length, n, dtype=torch.bool).tril(cached)
        want = torch.nn.functional.scaled_dot_product_attention(
            query[row:row + 1], buffers[0][row][:, :, :n], buffers[1][row][:, :, :n], attn_mask=sees, scale=0.125,
            enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(got[row:row + 1], want, rtol=1e-5, atol=1e-5)
        alone = ops.write_and_attend(query[row:row + 1], [copies[0][row]], [copies[1][row]], [cached],
                                     keys[row:row + 1], values[row:row + 1], 0.125)
        assert torch.equal(alone, got[row:row + 1])  # the batch changes no bit


def attention_at(levels: list[int], length: int) -> dict[int, torch.Tensor]:
    """A block's attention (48 queries of a group of 3 at 16 lanes: a pass of two vectors and one of a single
    vector) computed at each instruction set level: 0 plain, 1 AVX2, 2 AVX-512."""
    torch.manual_seed(3)
    lengths = [0, 16, 250, 700]
    query, keys, values = (torch.randn(len(lengths), heads, length, 64) for heads in (9, 3, 3))
    cached = [torch.randn(1, 3, 800, 64) for _ in range(2 * len(lengths))]
    results = {}
    try:
        for isa in levels:
            assert ops.attention_isa(isa) == isa
            buffers = [b.clone() for b in cached]
            results[isa] = ops.write_and_attend(query, buffers[:len(lengths)], buffers[len(lengths):], lengths, keys,
                                                values, 0.125)
    finally:
        ops.attention_isa(2)
    return results


def widest() -> int:
    """The widest level this CPU has (the kernels' default, set again)."""
    return ops.attention_isa(2)


@pytest.mark.parametrize("length", [16, 5, 32])
def test_a_block_s_attention_has_the_same_bits_at_either_vector_width(length: int) -> None:
    """AVX-512's 16 lanes and AVX2's 8 compute each query's arithmetic in the same order."""
    if widest() < 2:
        pytest.skip("no AVX-512 on this CPU: AVX2's 8 lanes are the only vector width to run")
    results = attention_at([1, 2], length)
    assert torch.equal(results[1], results[2])


@pytest.mark.parametrize("length", [16, 5, 32])
def test_a_block_s_attention_s_plain_build_agrees_with_its_vector_build_to_rounding(length: int) -> None:
    """The plain build, without fused multiply-adds, rounds differently: close, not equal."""
    most = widest()
    if most < 1:
        pytest.skip("no AVX2 on this CPU: the plain build is the only one to run")
    results = attention_at([0, most], length)
    torch.testing.assert_close(results[0], results[most], rtol=1e-5, atol=1e-5)


def test_a_decode_step_s_write_and_attention_in_one_call_are_the_two_calls_bit_for_bit() -> None:
    torch.manual_seed(1)
    lengths = [0, 4, 69, 256, 300]  # the first token of a row; short rows; a row whose keys take two runs
    rows = len(lengths)
    query, keys, values = torch.randn(rows, 9, 1, 64), torch.randn(rows, 3, 1, 64), torch.randn(rows, 3, 1, 64)
    buffers = [torch.randn(1, 3, 320, 64) for _ in range(rows)], [torch.randn(1, 3, 320, 64) for _ in range(rows)]
    copies = [b.clone() for b in buffers[0]], [b.clone() for b in buffers[1]]
    got = ops.write_and_attend(query, *buffers, lengths, keys, values, 0.125)
    row_keys, row_values = ops.write_rows(*copies, lengths, keys, values)
    assert torch.equal(got, ops.decode_attention(query, row_keys, row_values, 0.125))
    for have, expected in zip(buffers[0] + buffers[1], copies[0] + copies[1], strict=True):
        assert torch.equal(have, expected)  # the same writes, in place
    alone = ops.write_and_attend(query[2:3], [copies[0][2]], [copies[1][2]], [lengths[2] + 1], keys[2:3],
                                 values[2:3], 0.125)
    assert alone.shape == (1, 1, 9, 64)
    with pytest.raises(RuntimeError, match="no room"):
        ops.write_and_attend(query, *buffers, [320] * rows, keys, values, 0.125)
    with pytest.raises(RuntimeError, match="the same rows, tokens and head size"):
        ops.write_and_attend(query, *buffers, lengths, torch.randn(rows, 3, 2, 64), values, 0.125)


def test_decode_attention_refuses_what_it_cannot_read() -> None:
    query = torch.randn(2, 9, 1, 64)
    keys, values = keys_and_values([4, 4])
    with pytest.raises(RuntimeError, match="each row's keys and values"):
        ops.decode_attention(query, keys[:1], values[:1], 0.125)
    with pytest.raises(RuntimeError, match="do not match the query"):
        ops.decode_attention(query, [keys[0], keys[1][:, :2]], values, 0.125)
    with pytest.raises(RuntimeError, match="token after token"):
        heads_inner = [torch.randn(1, 4, 3, 64).transpose(1, 2) for _ in keys]  # tokens not adjacent
        ops.decode_attention(query, heads_inner, values, 0.125)
    with pytest.raises(RuntimeError, match="one float32 query"):
        ops.decode_attention(torch.randn(2, 9, 2, 64), keys, values, 0.125)


@pytest.mark.parametrize("rows", [1, 4])
def test_the_mlp_with_its_rotation_is_the_scripted_one_to_rounding_and_row_by_row(rows: int) -> None:
    torch.manual_seed(rows)
    o_proj, gate_up, down = linear(576, 576), linear(576, 3072), linear(1536, 576)
    rotation = InputRotation(1536)
    x, attended = torch.randn(rows, 576), torch.randn(rows, 576)
    got = ops.mlp_residual(x, attended, o_proj.weight, gate_up.weight, down.weight, 1e-5, InputRotation.BLOCK)
    want = scripted.PLAIN["mlp_residual"](x, attended, o_proj.packed, gate_up.packed, down.packed, None, 1e-5,
                                          rotation.block)
    # down_proj quantises its input: a rounding difference before it may move a value by one int8 step
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())
    assert (got - want).abs().median() < 1e-4
    for row in range(rows):
        alone = ops.mlp_residual(x[row:row + 1], attended[row:row + 1], o_proj.weight, gate_up.weight, down.weight,
                                 1e-5, InputRotation.BLOCK)
        assert torch.equal(alone, got[row:row + 1])
    plain = ops.mlp_residual(x, attended, o_proj.weight, gate_up.weight, down.weight, 1e-5, 0)
    unrotated = scripted.PLAIN["mlp_residual"](x, attended, o_proj.packed, gate_up.packed, down.packed, None, 1e-5,
                                               None)
    torch.testing.assert_close(plain, unrotated, rtol=0, atol=0.05 * unrotated.abs().max().item())


@pytest.fixture(scope="module")
def int8_model(int8_loaded: LoadedModel) -> nn.Module:
    return int8_loaded.model


def test_the_default_model_runs_the_kernels_and_agrees_with_the_scripted_layer(int8_model: nn.Module) -> None:
    layers = int8_model.model.layers
    assert all(isinstance(layer, Int8LlamaLayer) and layer.native for layer in layers)
    torch.manual_seed(0)
    ids = torch.randint(100, 1000, (3, 16))  # 12 prompt tokens, then 4 decode steps of given tokens

    @torch.inference_mode()
    def logits(flag: bool) -> torch.Tensor:
        use_native(int8_model, flag)
        cache = new_cache(int8_model.config, ragged=True)
        out = forward_parts(int8_model, [Part(ids[:, :12], torch.arange(12).expand(3, 12), cache)])
        for position in range(12, 16):
            out += forward_parts(int8_model, [Part(ids[:, position:position + 1], torch.full((3, 1), position), cache)])
        return torch.stack(out)

    try:
        compiled, script = logits(True), logits(False)
    finally:
        logits(True)
    # int8 rounds activations, so a last-bit difference may move some by one step: close, not equal
    assert torch.nn.functional.cosine_similarity(compiled, script, dim=-1).min() > 0.999
    top2 = script.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 0.5  # where the scripted layer's choice is not a near tie
    assert clear.sum() >= 5
    assert torch.equal(compiled.argmax(-1)[clear], script.argmax(-1)[clear])


def test_the_setting_s_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """off never builds the kernels and says there are none; on and auto build them once per process (as a fresh
    worker does: here the builder finds them built) and say they are loaded; any other value is refused."""
    from torch.utils import cpp_extension

    builds: list[str] = []
    build = cpp_extension.load

    def counted(**kwargs: object) -> object:
        builds.append(str(kwargs["name"]))
        return build(**kwargs)

    monkeypatch.setattr(native, "_build", None)  # as at a worker's start
    monkeypatch.setattr(cpp_extension, "load", counted)
    assert native.load("off") is False and builds == [] and not native.loaded()
    assert native.load("on") is True and builds == [native.NAME] and native.loaded()
    assert native.load("auto") is True and native.load("on") is True and builds == [native.NAME]
    assert native.load("off") is False
    with pytest.raises(ValueError, match="WORKER_NATIVE"):
        native.load("maybe")
    with pytest.raises(SettingsError, match="WORKER_NATIVE"):
        Settings(worker_native="yes").check()


def test_worker_isa_caps_both_kernel_files_and_auto_gives_the_cpu_s_widest_back() -> None:
    widest = (ops.block_isa(2), ops.attention_isa(2))
    try:
        assert native.cap("plain") == (0, 0)
        assert native.cap("avx2") == (min(1, widest[0]), min(1, widest[1]))
        assert native.cap("avx512") == widest
        native.cap("plain")
        assert native.cap("auto") == widest
    finally:
        native.cap("auto")
    with pytest.raises(SettingsError, match="WORKER_ISA"):
        Settings(worker_isa="sse4").check()


def test_a_failed_build_falls_back_or_stops_the_worker(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    from torch.utils import cpp_extension

    def no_compiler(**kwargs: object) -> None:
        raise RuntimeError("Error building extension 'llmserve_native'\nc++: not found")

    monkeypatch.setattr(native, "_build", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert native.load("auto") is False
    assert "c++: not found" in caplog.records[-1].error
    with pytest.raises(native.NativeError, match=r"did not build: RuntimeError: c\+\+: not found"):
        native.load("on")


def test_a_hit_s_blocks_join_into_the_cache_as_the_torch_join_puts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig

    from worker.own.cache import stacked_cache
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(3)
    rows = [[torch.randn(3, 2, 2, 16, 16) for _ in range(3)],
            [torch.randn(3, 2, 2, 32, 16), torch.randn(3, 2, 2, 16, 16)]]  # the same length, other blocks
    compiled = stacked_cache(config, rows, ragged=True, capacity=80)
    monkeypatch.setattr(native, "loaded", lambda: False)
    joined = stacked_cache(config, rows, ragged=True, capacity=80)
    for mine, theirs in zip(compiled.layers, joined.layers, strict=True):
        assert mine.rows.lengths == theirs.rows.lengths == [48, 48]
        for row in range(2):
            assert all(torch.equal(x, y) for x, y in zip(mine.row(row), theirs.row(row), strict=True))
    assert torch.equal(compiled.layers[2].row(1)[1][:, :, 32:], rows[1][1][2, 1].unsqueeze(0))  # values, in order
    with pytest.raises(RuntimeError, match="no room"):
        ops.join_blocks(rows[0], [torch.zeros(2, 2, 40, 16)] * 3, [torch.zeros(2, 2, 40, 16)] * 3, 0)
