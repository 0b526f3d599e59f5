"""The files and shapes users bring (issue 44): every GGUF block type taken to the kernels' two
(worker/weights/transcode.py), Llama 3's rotary scaling from the file (worker/weights/rope.py), and Qwen 2's biased
q, k and v on the int8 and block paths, each against float32 transformers on the same weights."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from common.settings import Settings
from tests.conftest import native_kernels
from worker.own.cache import new_cache
from worker.own.forward import Part, forward_parts
from worker.own.model import load_model
from worker.prompts import bundled_gguf
from worker.weights import paths, transcode
from worker.weights.blocks import BlockError, BlockLinear, BlockLlamaLayer, FileTensor, quantize_blocks, read_tensors
from worker.weights.from_file import FileEmbedding
from worker.weights.quant import Int8LlamaLayer, RowwiseLlamaLayer, plain_llama, quantize_int8
from worker.weights.rope import FACTORS, take_file_factors

native_kernels()
T = gguf.GGMLQuantizationType


def k_quant_rows(kind: T, n: int, k: int, seed: int) -> np.ndarray:
    """Rows of random K-quant super-blocks (gguf cannot quantize to them): any codes and sub-block scales, the
    super-block's float16 scales of a trained layer's size."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    if kind == T.Q6_K:  # the scale last
        raw[..., -2:] = rng.uniform(1e-4, 1e-3, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    else:  # d and dmin first
        raw[..., :4] = rng.uniform(1e-4, 1e-3, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def file_rows(kind: T, n: int, k: int, seed: int) -> np.ndarray:
    if kind in (T.Q4_K, T.Q5_K, T.Q6_K):
        return k_quant_rows(kind, n, k, seed)
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.02
    return quants.quantize(weights, kind).reshape(n, -1).view(np.uint8)


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32])
def test_every_block_type_reaches_the_kernels_holding_the_file_s_weights(kind: T) -> None:
    n, k = 48, 512
    rows = file_rows(kind, n, k, seed=kind.value)
    layer = BlockLinear([FileTensor("w", kind, (k, n), rows)])
    want = torch.from_numpy(quants.dequantize(rows, kind).reshape(n, k).astype(np.float32))
    got = layer.dequantized()
    assert layer.kind == (transcode.Q4_1 if kind in (T.Q4_0, T.Q4_K) else
                          transcode.Q5_1 if kind in (T.Q5_0, T.Q5_1, T.Q5_K) else transcode.Q8_0)
    assert layer.exact == (kind in (T.Q4_0, T.Q5_0, T.Q5_1))
    if layer.exact:
        assert torch.equal(got, want)
    error = ((got - want).abs().amax(dim=1) / want.abs().amax(dim=1)).max().item()
    assert error <= transcode.TOLERANCE
    # Wrong rows are far outside the tolerance the loader allows (blocks.holds).
    assert ((got.roll(1, 0) - want).abs().amax(dim=1) / want.abs().amax(dim=1)).max().item() > 10 * transcode.TOLERANCE
    x = torch.randn(5, k)
    assert F.cosine_similarity(layer(x), x @ want.T, dim=-1).min() > 0.999


def test_a_matrix_taken_to_q8_0_by_parts_is_the_whole_one_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transcoding goes a few rows at a time (no float32 copy of a whole output layer at the load's peak)."""
    rows = k_quant_rows(T.Q6_K, 50, 512, 4)
    whole = quants.quantize(quants.dequantize(rows, T.Q6_K).astype(np.float32), T.Q8_0)
    monkeypatch.setattr(transcode, "CHUNK_ROWS", 16)  # 50 rows: three whole parts and a short one
    assert np.array_equal(transcode.transcode(rows, T.Q6_K, T.Q8_0), whole)


def test_a_fused_matrix_of_mixed_types_is_one_type_and_unreadable_ones_are_refused() -> None:
    q4k, q6k = k_quant_rows(T.Q4_K, 32, 256, 1), k_quant_rows(T.Q6_K, 16, 256, 2)
    fused = BlockLinear([FileTensor("q", T.Q4_K, (256, 32), q4k), FileTensor("v", T.Q6_K, (256, 16), q6k)])
    assert fused.kind == transcode.Q8_0 and fused.out_features == 48  # as llama-quantize's Q4_K_M mixes a layer
    alone = BlockLinear([FileTensor("q", T.Q4_K, (256, 32), q4k), FileTensor("k", T.Q4_0, (256, 16),
                                                                           file_rows(T.Q4_0, 16, 256, 3))])
    assert alone.kind == transcode.Q4_1
    q5_0 = file_rows(T.Q5_0, 16, 256, 5)
    five = BlockLinear([FileTensor("q", T.Q4_0, (256, 16), file_rows(T.Q4_0, 16, 256, 3)),
                        FileTensor("v", T.Q5_0, (256, 16), q5_0)])
    assert five.kind == transcode.Q5_1 and five.exact  # both exactly Q5_1's arithmetic
    want = np.concatenate([quants.dequantize(p, kind) for p, kind in
                           ((file_rows(T.Q4_0, 16, 256, 3), T.Q4_0), (q5_0, T.Q5_0))])
    assert torch.equal(five.dequantized(), torch.from_numpy(want.reshape(32, 256).astype(np.float32)))
    with_k = BlockLinear([FileTensor("q", T.Q4_K, (256, 32), q4k), FileTensor("v", T.Q5_0, (256, 16), q5_0)])
    assert with_k.kind == transcode.Q5_1 and not with_k.exact  # Q4_K's sub-block scales are rounded
    ternary = np.zeros((4, gguf.GGML_QUANT_SIZES[T.TQ1_0][1]), np.uint8)
    with pytest.raises(BlockError, match="TQ1_0, which the kernels cannot take"):
        BlockLinear([FileTensor("t", T.TQ1_0, (256, 4), ternary)])


@pytest.fixture(scope="module")
def requantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The shipped file requantized by llama.cpp's own quantizer (the llama-cpp-python library the llamacpp engine
    uses), as users download it: Q4_K_M mixes Q4_K, Q6_K and, where a row of 576 is no multiple of 256, Q5_0."""
    folder = tmp_path_factory.mktemp("requantized")
    files = {}
    for name, ftype in (("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M), ("Q6_K", llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K)):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
        out = folder / f"model-{name}.gguf"
        assert llama_cpp.llama_model_quantize(bundled_gguf().encode(), str(out).encode(), ctypes.byref(params)) == 0
        (folder / name).mkdir()
        (folder / name / "model.gguf").symlink_to(out)
        files[name] = folder / name
    return files


@pytest.mark.parametrize("name", ["Q4_K_M", "Q6_K"])
def test_a_requantized_file_runs_on_the_blocks_close_to_its_own_float32(requantized: dict[str, Path],
                                                                         name: str) -> None:
    settings = dict(worker_threads=1, model=str(requantized[name]), model_file="model.gguf")
    blocks = load_model(Settings(**settings, worker_quant="gguf"))
    fp32 = load_model(Settings(**settings, worker_quant="none")).model
    assert blocks.weights == "gguf"
    kinds = {t.kind for t in _file_kinds(requantized[name] / "model.gguf")}
    assert (T.Q4_K in kinds) == (name == "Q4_K_M") and T.Q6_K in kinds  # what the test is about
    torch.manual_seed(0)
    ids = torch.randint(100, 5000, (2, 16))
    with torch.inference_mode():
        cache = new_cache(blocks.model.config, ragged=True)
        got = forward_parts(blocks.model, [Part(ids, torch.arange(16).expand(2, 16), cache)])[0]
        want = fp32(ids).logits[:, -1]
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.995


def _file_kinds(path: Path) -> list[FileTensor]:
    return [t for t in read_tensors(str(path)).values() if len(t.shape) == 2]


def tiny_llama(rope: dict | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters=rope or {"rope_type": "default", "rope_theta": 500000.0})
    return LlamaForCausalLM(config).eval()


def test_llama_3_s_rotary_scaling_is_taken_from_the_file() -> None:
    """transformers loads a GGUF Llama 3 with the default rotary embedding; the file's rope_freqs (llama.cpp's
    divisors of each frequency) make it the model's own again."""
    llama3 = tiny_llama({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    loaded = tiny_llama()  # what transformers makes of the file
    loaded.load_state_dict(llama3.state_dict())
    divisors = (loaded.model.rotary_emb.inv_freq / llama3.model.rotary_emb.inv_freq).numpy().astype(np.float32)
    assert divisors.max() > 2  # the scaling slows some frequencies down
    ids = torch.randint(0, 512, (1, 300))
    with torch.inference_mode():
        want = llama3(ids).logits
        assert not torch.allclose(loaded(ids).logits, want, atol=1e-4)
        assert take_file_factors(loaded, {FACTORS: FileTensor(FACTORS, T.F32, (16,), divisors.view(np.uint8)[None])})
        assert torch.allclose(loaded(ids).logits, want, atol=1e-4)
    assert plain_llama(llama3)  # a position-only rotary type: the int8 and block paths take it


def tiny_qwen(version: int) -> PreTrainedModel:
    """Qwen 2's shape with biases on q, k and v that matter, or Qwen 3's with gains on its query and key head norms
    that matter (and a head width of its own, as Qwen 3's configs set it)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False)
    model = (Qwen2ForCausalLM(Qwen2Config(**shape)) if version == 2
             else Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=64))).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if version == 2:
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
            else:
                attn.q_norm.weight.uniform_(0.2, 3.0)
                attn.k_norm.weight.uniform_(0.2, 3.0)
    return model


def ragged_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """A prefill then two decode steps through the engine's forward, over a ragged cache."""
    rows, length = ids.shape
    with torch.inference_mode():
        cache = new_cache(model.config, ragged=True)
        out = [forward_parts(model, [Part(ids[:, :-2], torch.arange(length - 2).expand(rows, -1), cache)])[0]]
        out += [forward_parts(model, [Part(ids[:, p:p + 1], torch.full((rows, 1), p), cache)])[0]
                for p in (length - 2, length - 1)]
    return torch.stack(out, dim=1)


def float_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits[:, -3:]


@pytest.mark.parametrize("version", [2, 3])
def test_qwen_s_biases_and_head_norms_run_on_int8(version: int) -> None:
    model = tiny_qwen(version)
    ids = torch.randint(0, 512, (2, 12))
    want = float_logits(model, ids)
    quantize_int8(model, native=True)
    assert all(isinstance(layer, Int8LlamaLayer) for layer in model.model.layers)
    assert F.cosine_similarity(ragged_logits(model, ids), want, dim=-1).min() > 0.99


@pytest.mark.parametrize("version", [2, 3])
def test_qwen_s_biases_and_head_norms_run_on_the_blocks(tmp_path: Path, version: int) -> None:
    """A Qwen file (Q8_0, q and k in the file's own row order: NeoX rotation, nothing interleaved) on the blocks,
    the compiled layer stack adding the biases or norming the heads, against float32 of the same weights; and the
    same tokens through the layers' general path (a dozen calls a layer) as through the stack in one call."""
    model = tiny_qwen(version)
    write_q8_file(model, tmp_path / "qwen.gguf", f"qwen{version}")
    ids = torch.randint(0, 512, (2, 12))
    want = float_logits(model, ids)
    quantize_blocks(model, str(tmp_path / "qwen.gguf"))
    layers = model.model.layers
    assert all(isinstance(layer, BlockLlamaLayer) for layer in layers)
    assert all((layer.qkv_bias is not None, len(layer.head_norms)) == (version == 2, 0 if version == 2 else 2)
               for layer in layers)
    got = ragged_logits(model, ids)
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.999
    general = [RowwiseLlamaLayer.forward_parts.__get__(layer) for layer in layers]
    for layer, forward in zip(layers, general, strict=True):
        layer.forward_parts, layer.stack = forward, None  # the Python path, one layer at a time
    assert torch.allclose(ragged_logits(model, ids), got, atol=1e-4)


def write_q8_file(model: PreTrainedModel, path: Path, arch: str) -> None:
    """The model's matrices as a GGUF file's Q8_0 tensors, by llama.cpp's names (the file holds nothing else: the
    blocks read only its tensors); the model takes the file's (rounded) weights."""
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(path), arch)

    def put(name: str, linear: torch.nn.Linear) -> None:
        rows = quants.quantize(linear.weight.detach().numpy(), T.Q8_0)
        writer.add_tensor(name, rows, raw_dtype=T.Q8_0)
        linear.weight.data = torch.from_numpy(quants.dequantize(rows, T.Q8_0).copy())

    for i, layer in enumerate(model.model.layers):
        for module in (layer.self_attn, layer.mlp):
            for attr, short in names.items():
                if hasattr(module, attr):
                    put(f"blk.{i}.{short}.weight", getattr(module, attr))
    put("output.weight", model.lm_head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_model_built_from_its_file_alone_gives_the_bits_of_transformers_model_on_the_blocks() -> None:
    """WORKER_QUANT=auto builds a GGUF model on the meta device and reads only the file (no float32 copy of the
    model): the same logits, bit for bit, as transformers' own loading with the blocks put in after."""
    lean = load_model(Settings(worker_threads=1))
    assert lean.weights == "gguf" and isinstance(lean.model.model.embed_tokens, FileEmbedding)
    assert not any(t.is_meta for t in [*lean.model.parameters(), *lean.model.buffers()])
    full = load_model(Settings(worker_threads=1, worker_quant="none"))
    quantize_blocks(full.model, bundled_gguf())
    assert (lean.eos_token_ids, lean.max_length) == (full.eos_token_ids, full.max_length)
    ids = torch.randint(100, 5000, (2, 14))
    got, want = ragged_logits(lean.model, ids), ragged_logits(full.model, ids)
    assert torch.equal(got, want)
    with torch.inference_mode():
        assert torch.equal(lean.model(ids).logits, full.model(ids).logits)  # transformers' forward too


def test_a_model_whose_attention_int8_cannot_compute_runs_in_float32_or_stops_at_start(caplog) -> None:
    """Gemma 3's sliding window is not row-wise attention's plain causal mask: `auto` falls back to float32 with a
    warning naming why (and ENGINE=llamacpp), `int8` stops the worker at start; never a worker that starts and
    then fails every request."""
    config = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert paths.apply(model, "int8", Settings()) == "none"
    assert any("int8 cannot serve" in r.message and "sliding" in r.error for r in caplog.records)
    with torch.inference_mode():
        assert model(torch.randint(0, 512, (1, 20))).logits.shape == (1, 20, 512)  # it serves
    with pytest.raises(ValueError, match="WORKER_QUANT=int8: gemma3_text's attention"):
        paths.apply(Gemma3ForCausalLM(config).eval(), "int8", Settings(worker_quant="int8"))
    llama = tiny_llama()
    assert paths.apply(llama, "int8", Settings()) == "int8"  # a plain causal one still takes int8
