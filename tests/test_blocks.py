"""worker/weights/blocks.py and blocks.cpp: a GGUF file's own Q4_1, Q5_1 and Q8_0 blocks as the weights. The packed
blocks hold the file's values exactly; the product is a plain torch statement of its arithmetic bit for bit,
on every instruction set this CPU has; a row's result does not depend on its batch; the default model runs on
them, close to float32; and the settings fail or fall back as documented."""

from __future__ import annotations

import logging
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.settings import Settings
from tests.conftest import native_kernels
from worker.own.cache import new_cache, select_rows
from worker.own.forward import Part, forward_parts
from worker.own.model import LoadedModel, load_model
from worker.prompts import bundled_gguf
from worker.weights import blocks, native
from worker.weights.blocks import Q4_1, Q8_0, BlockError, BlockLinear, BlockLlamaLayer, FileTensor, quantize_blocks
from worker.weights.quant import Int8LlamaLayer, RowwiseLlamaLayer, takes_blocks_together
from worker.weights.transcode import Q5_1

native_kernels()
ops = torch.ops.llmserve
ISAS = sorted({ops.block_isa(level) for level in (0, 1, 2)})  # what this CPU has: plain, AVX2, AVX-512 VNNI
ops.block_isa(2)


def assert_the_same_on_every_instruction_set(layer: BlockLinear, x: torch.Tensor, want: torch.Tensor) -> None:
    try:
        for isa in ISAS:
            assert ops.block_isa(isa) == isa
            assert torch.equal(layer(x), want), f"instruction set {isa}"
    finally:
        ops.block_isa(2)


def random_blocks(kind, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF rows of random blocks ([n, bytes]): scales and minima of a trained layer's size, any codes."""
    rng = np.random.default_rng(seed)
    blocks = k // 32
    scale = (rng.standard_normal((n, blocks, 1)) * 0.01).astype(np.float16).view(np.uint8)
    if kind in (Q4_1, Q5_1):
        minimum = (rng.standard_normal((n, blocks, 1)) * 0.05).astype(np.float16).view(np.uint8)
        codes = rng.integers(0, 256, (n, blocks, 16 if kind == Q4_1 else 20), dtype=np.uint8)  # Q5_1: fifth bits
        return np.concatenate([scale, minimum, codes], axis=-1).reshape(n, -1)
    codes = rng.integers(-127, 128, (n, blocks, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([scale, codes], axis=-1).reshape(n, -1)


def block_linear(kind, n: int, k: int, seed: int = 0) -> tuple[BlockLinear, np.ndarray]:
    raw = random_blocks(kind, n, k, seed)
    return BlockLinear([FileTensor("w", kind, (k, n), raw)]), raw


def activations(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different sizes, with an outlier channel and a block of zeros."""
    torch.manual_seed(seed)
    x = torch.randn(rows, k) * torch.logspace(-3, 2, rows)[:, None]
    x[:, 5] *= 40
    x[:, 32:64] = 0
    return x


def reference(x: torch.Tensor, raw: np.ndarray, kind) -> torch.Tensor:
    """blocks.cpp's arithmetic in torch: each block of a row quantised to 8 bits (scale max / 127, ties to
    even), each block's integer sum of products, then over the blocks in order acc + sum * (d a) [+ m (a sum q)],
    each a fused multiply-add."""
    rows, k = x.shape
    n, blocks = raw.shape[0], k // 32
    per = raw.reshape(n, blocks, -1)
    d = torch.from_numpy(per[..., 0:2].copy().view(np.float16)).float()[..., 0]
    if kind in (Q4_1, Q5_1):
        m = torch.from_numpy(per[..., 2:4].copy().view(np.float16)).float()[..., 0]
        qs = torch.from_numpy(per[..., -16:].copy()).long()
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)
        if kind == Q5_1:  # bit i of the 32-bit word after the minimum: code i's fifth
            word = torch.from_numpy(per[..., 4:8].copy().view("<u4").astype(np.int64))
            codes |= ((word >> torch.arange(32)) & 1) << 4
    else:
        codes = torch.from_numpy(per[..., 2:].copy().view(np.int8)).long()
    xb = x.view(rows, blocks, 32)
    top = xb.abs().amax(-1)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros(()))
    q = torch.round(xb * inverse[..., None]).clamp(-127, 127)
    a = top / torch.tensor(127.0)
    scaled_sum = a * q.sum(-1)
    sums = torch.einsum("rbi,nbi->rnb", q.long(), codes).float()
    def fma(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (x.double() * y.double() + z.double()).float()  # x * y exact in float64, one rounding to float32

    acc = torch.zeros(rows, n)
    for b in range(blocks):
        acc = fma(sums[:, :, b], d[None, :, b] * a[:, b, None], acc)
        if kind != Q8_0:
            acc = fma(m[None, :, b], scaled_sum[:, b, None], acc)
    return acc


@pytest.mark.parametrize("kind", [Q4_1, Q5_1, Q8_0])
@pytest.mark.parametrize("rows", [1, 5, 7, 13])  # every row group: 8, 4, 2 and 1
def test_the_product_is_its_arithmetic_in_torch_bit_for_bit_on_every_instruction_set(kind, rows: int) -> None:
    layer, raw = block_linear(kind, 40, 96, seed=rows)  # 40 outputs: the last tile half empty
    x = activations(rows, 96, seed=rows)
    want = reference(x, raw, kind)
    assert_the_same_on_every_instruction_set(layer, x, want)
    float_product = x @ layer.dequantized().T  # and close to the float product: only activations are rounded
    assert (want - float_product).norm() < 0.02 * float_product.norm()


@pytest.mark.parametrize("kind", [Q4_1, Q5_1, Q8_0])
def test_the_largest_codes_and_activations_keep_their_exact_sums(kind) -> None:
    """Every code at its extreme against activations at +-127 in every row: the largest integer sums a kernel
    can meet (AVX2 holds a Q4_1 block's in 16 bits before widening them, and a Q5_1 block's two steps of four at
    a time), still the reference's on every instruction set."""
    raw = random_blocks(kind, 32, 128, seed=4)
    per = raw.reshape(32, 4, -1)
    if kind != Q8_0:
        per[..., 4:] = 0xFF  # both nibbles 15 (and every fifth bit: 31)
    else:
        per[..., 2:] = np.array(127, np.int8).view(np.uint8)
        per[16:, :, 2:] = np.array(-127, np.int8).view(np.uint8)
    layer = BlockLinear([FileTensor("w", kind, (128, 32), raw)])
    x = torch.ones(6, 128)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs
    x[3:] *= torch.tensor([[1e-3], [1.0], [1e3]])
    want = reference(x, raw, kind)
    assert_the_same_on_every_instruction_set(layer, x, want)


@pytest.mark.parametrize("kind", [Q4_1, Q5_1, Q8_0])
def test_a_row_s_result_is_the_same_alone_and_in_any_batch(kind) -> None:
    layer, _ = block_linear(kind, 64, 576, seed=3)
    x = activations(21, 576)  # row groups of 8, 4, 2 and 1 in one call
    batch = layer(x)
    order = torch.randperm(21)
    assert torch.equal(layer(x[order]), batch[order])
    for row in range(21):
        assert torch.equal(layer(x[row:row + 1]), batch[row:row + 1])
    assert torch.equal(layer(x.view(3, 7, 576)), batch.view(3, 7, -1))  # any leading shape


def test_a_kernel_level_whose_bits_differ_from_the_plain_loops_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker checks its CPU's kernels against the plain loops at start (a new kernel may never have run on a
    CPU of its kind): every level this CPU has agrees, and one made to differ is stepped down from."""
    top = ISAS[-1]
    try:
        assert blocks.agreeing_level(top) == top
        real_isa, real_linear = ops.block_isa, native.ops.block_linear
        now = {}

        def block_isa(most: int) -> int:
            now["level"] = real_isa(most)
            return now["level"]

        def block_linear(*args):
            out = real_linear(*args)
            return out.add_(1e-3) if now["level"] == top else out

        monkeypatch.setattr(native.ops, "block_isa", block_isa)
        monkeypatch.setattr(native.ops, "block_linear", block_linear)
        assert blocks.agreeing_level(top) == top - 1 and now["level"] == top - 1
    finally:
        ops.block_isa(2)


def test_the_packed_blocks_hold_the_file_s_values() -> None:
    for kind in (Q4_1, Q5_1, Q8_0):
        layer, raw = block_linear(kind, 37, 64)
        want = torch.from_numpy(gguf.quants.dequantize(raw, kind))
        assert torch.equal(layer.dequantized(), want)


def test_a_gain_normalises_first_and_the_mlp_is_its_parts() -> None:
    torch.manual_seed(1)
    x, gain = activations(6, 96), torch.rand(96) + 0.5
    layer, _ = block_linear(Q4_1, 32, 96)
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gain
    torch.testing.assert_close(layer(x, gain, 1e-5), layer(normed), rtol=1e-3, atol=1e-3 * layer(normed).abs().max())
    o_proj, _ = block_linear(Q4_1, 96, 64, seed=1)
    gate_up, _ = block_linear(Q4_1, 2 * 128, 96, seed=2)
    down, _ = block_linear(Q4_1, 96, 128, seed=3)
    attended = activations(6, 64, seed=4)
    got = ops.block_mlp_residual(x, attended, o_proj.packed, gate_up.packed, down.packed, 128, gain, 1e-5)
    h = x + o_proj(attended)
    gate, up = gate_up(h, gain, 1e-5).chunk(2, dim=-1)
    want = h + down(F.silu(gate) * up)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_the_mlp_s_activation_has_the_same_bits_in_vectors_as_in_plain_loops() -> None:
    """silu(gate) * up in vectors of 16 or 8 (WORKER_ISA's levels) and in plain loops: the same bits, gates far
    into exp's clamped range included."""
    x, gain = activations(5, 96, seed=5) * 40, torch.rand(96) + 0.5
    o_proj, _ = block_linear(Q4_1, 96, 64, seed=6)
    gate_up, _ = block_linear(Q4_1, 2 * 128, 96, seed=7)
    down, _ = block_linear(Q4_1, 96, 128, seed=8)
    attended = activations(5, 64, seed=9)
    levels = sorted({ops.attention_isa(level) for level in (0, 1, 2)})
    results = {}
    try:
        for level in levels:
            assert ops.attention_isa(level) == level
            results[level] = ops.block_mlp_residual(x, attended, o_proj.packed, gate_up.packed, down.packed, 128,
                                                    gain, 1e-5)
    finally:
        ops.attention_isa(2)
    for level in levels:
        assert torch.equal(results[level], results[0]), f"instruction set {level}"


def test_what_does_not_fit_is_refused_with_a_message() -> None:
    layer, _ = block_linear(Q4_1, 32, 64)
    with pytest.raises(RuntimeError, match="do not fit"):
        layer(torch.randn(2, 96))  # another input width
    with pytest.raises(RuntimeError, match="float32"):
        layer(torch.randn(2, 64, dtype=torch.float64))
    mixed = BlockLinear([FileTensor("a", Q4_1, (64, 4), random_blocks(Q4_1, 4, 64, 0)),
                         FileTensor("b", Q8_0, (64, 4), random_blocks(Q8_0, 4, 64, 0))])
    assert mixed.kind == Q8_0 and not mixed.exact  # one type a matrix (tests/test_user_models.py)


def test_the_default_model_runs_on_its_file_s_blocks_close_to_float32(loaded: LoadedModel,
                                                                      float_loaded: LoadedModel) -> None:
    blocks, fp32 = loaded.model, float_loaded.model
    assert all(isinstance(layer, BlockLlamaLayer) for layer in blocks.model.layers)
    assert isinstance(blocks.lm_head, BlockLinear) and blocks.lm_head.kind == Q8_0
    assert {layer.qkv.kind for layer in blocks.model.layers} == {Q4_1}
    assert takes_blocks_together(blocks)  # the engine's prefill takes several blocks in one forward
    torch.manual_seed(0)
    ids = torch.randint(100, 5000, (2, 24))
    with torch.inference_mode():
        cache = new_cache(blocks.config, ragged=True)
        got = forward_parts(blocks, [Part(ids[:, :20], torch.arange(20).expand(2, 20), cache)])[0]
        steps = [forward_parts(blocks, [Part(ids[:, p:p + 1], torch.full((2, 1), p), cache)])[0] for p in range(20, 24)]
        want = fp32(ids).logits
    compared = 0
    for p, logits in zip(range(19, 24), [got, *steps], strict=True):
        assert F.cosine_similarity(logits, want[:, p], dim=-1).min() > 0.999
        top2 = want[:, p].topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 0.5  # where float32's choice is not a near tie
        assert torch.equal(logits.argmax(-1)[clear], want[:, p].argmax(-1)[clear])
        compared += int(clear.sum())
    assert compared >= 4  # of the 10 positions: the choices compared are not a vacuous few


def test_the_stack_in_one_call_gives_the_bits_of_its_layers_one_by_one(loaded: LoadedModel,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """block_layers (every layer of one part over a ragged cache, in one call) against block_layer called layer by
    layer, and both against the general path's dozen calls a layer: a prefill, a row leaving, then decode steps,
    each path over its own cache of the same tokens."""
    model = loaded.model
    torch.manual_seed(1)
    ids = torch.randint(100, 5000, (3, 14))

    def run() -> list[torch.Tensor]:
        cache = new_cache(model.config, ragged=True)
        with torch.inference_mode():
            out = [forward_parts(model, [Part(ids[:, :10], torch.arange(10).expand(3, 10), cache)])[0]]
            select_rows(cache, [0, 2])  # a row leaves: the rest go on
            out += [forward_parts(model, [Part(ids[[0, 2], p:p + 1], torch.full((2, 1), p), cache)])[0]
                    for p in range(10, 14)]
        return out

    calls = {"block_layers": 0, "block_layer": 0}

    def counting(name: str, op: Callable) -> Callable:
        def counted(*args: object) -> torch.Tensor:
            calls[name] += 1
            return op(*args)
        return counted

    for name in calls:
        monkeypatch.setattr(native.ops, name, counting(name, getattr(native.ops, name)))
    whole = run()
    assert calls == {"block_layers": 5, "block_layer": 0}  # one call a forward
    monkeypatch.setattr(BlockLlamaLayer, "forward_stack", RowwiseLlamaLayer.forward_stack)
    by_layer = run()
    assert calls == {"block_layers": 5, "block_layer": 5 * model.config.num_hidden_layers}
    monkeypatch.setattr(BlockLlamaLayer, "forward_parts", RowwiseLlamaLayer.forward_parts)
    for got, one_by_one, want in zip(whole, by_layer, run(), strict=True):
        assert torch.equal(got, one_by_one)
        assert torch.equal(got, want)


def test_a_model_that_differs_from_its_file_is_refused() -> None:
    fp32 = load_model(Settings(worker_threads=1, worker_quant="none")).model
    with torch.no_grad():
        fp32.model.layers[2].mlp.up_proj.weight[7, 3] += 1e-3
    layers = list(fp32.model.layers)
    with pytest.raises(BlockError, match=r"blk\.2\.ffn_gate\.weight, blk\.2\.ffn_up\.weight do not hold"):
        quantize_blocks(fp32, bundled_gguf())
    assert list(fp32.model.layers) == layers  # nothing replaced


def test_the_settings_fail_or_fall_back_as_documented(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    with pytest.raises(ValueError, match="WORKER_QUANT=gguf: the compiled kernels are not loaded"):
        load_model(Settings(worker_threads=1, worker_quant="gguf", worker_native="off"))
    with caplog.at_level(logging.WARNING, logger="worker"):
        loaded = load_model(Settings(worker_threads=1, worker_native="off"))
    assert loaded.weights == "int8"
    assert all(isinstance(layer, Int8LlamaLayer) and not layer.native for layer in loaded.model.model.layers)
    assert any("blocks cannot serve" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="WORKER_QUANT must be auto, gguf, int8 or none"):
        load_model(Settings(worker_quant="q4"))
    monkeypatch.setattr("worker.own.model.gguf_path", lambda settings: None)
    with pytest.raises(ValueError, match="WORKER_QUANT=gguf needs a local GGUF file"):
        load_model(Settings(worker_quant="gguf"))
