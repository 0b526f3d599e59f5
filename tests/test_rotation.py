"""The residual-stream rotation folded into a Llama's weights before int8 (worker/weights/rotation.py): the matrices
are orthogonal, the float model's function does not change, and the real model's int8 logits come closer
to float32's with it than without."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from common.settings import Settings
from worker.own.model import load_model
from worker.weights.quant import quantize_int8
from worker.weights.rotation import InputRotation, hadamard, orthogonal, rotate_residual


@pytest.mark.parametrize("n", [2, 12, 64, 576, 1536])
def test_hadamard_matrices_are_orthogonal_with_entries_of_one_size(n: int) -> None:
    matrix = hadamard(n)
    assert matrix is not None and matrix.shape == (n, n)
    assert torch.allclose(matrix @ matrix.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(matrix.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


def test_other_orders_get_a_fixed_orthogonal_matrix() -> None:
    assert hadamard(40) is None
    matrix = orthogonal(40)
    assert torch.allclose(matrix @ matrix.T, torch.eye(40, dtype=torch.float64), atol=1e-12)
    assert torch.equal(matrix, orthogonal(40))  # the same at every load: a worker's weights do not vary


@pytest.mark.parametrize("n", [1536, 128])
def test_an_input_rotation_is_orthogonal_and_its_fold_undoes_it(n: int) -> None:
    rotation, x = InputRotation(n), torch.randn(4, 3, n)
    matrix = torch.block_diag(*[hadamard(InputRotation.BLOCK)] * (n // InputRotation.BLOCK))  # H itself
    assert torch.allclose(matrix @ matrix.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(rotation(x).double(), x.double() @ matrix, atol=1e-5)
    linear = torch.nn.Linear(n, 24, bias=False)
    before = linear(x)
    rotation.fold(linear)
    assert torch.allclose(linear(rotation(x)), before, atol=1e-5)
    assert torch.equal(rotation(x[2:3]), rotation(x)[2:3])  # each row alone, bit for bit
    with pytest.raises(ValueError, match="multiple of 128, not 576"):
        InputRotation(576)


@pytest.mark.parametrize("hidden", [48, 40])  # a Hadamard order, and one without
def test_a_rotated_llama_gives_the_same_logits(hidden: int) -> None:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=200, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    for norm in [model.model.norm] + [n for layer in model.model.layers
                                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]:
        norm.weight.data.uniform_(0.5, 2.0)  # gains other than 1, as trained models have
    rotated = copy.deepcopy(model)
    rotate_residual(rotated)
    assert rotated.model.embed_tokens.weight is not rotated.lm_head.weight
    assert torch.equal(rotated.model.layers[0].input_layernorm.weight, torch.ones(hidden))
    ids = torch.randint(0, 200, (2, 7))

    @torch.inference_mode()
    def prefill_and_step(m: LlamaForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
        cache = DynamicCache(config=config)
        first = m(input_ids=ids, cache=cache).logits
        return first, m(input_ids=ids[:, :1], cache=cache).logits

    for before, after in zip(prefill_and_step(model), prefill_and_step(rotated), strict=True):
        assert torch.allclose(before, after, atol=1e-5, rtol=1e-4)
    assert not torch.equal(model.model.layers[0].self_attn.v_proj.weight,
                           rotated.model.layers[0].self_attn.v_proj.weight)


def test_the_rotation_brings_the_real_int8_model_closer_to_float32() -> None:
    loaded = load_model(Settings(worker_threads=1, worker_quant="none"))
    ids = torch.tensor([loaded.tokenizer(argparse.__doc__)["input_ids"][:256]])  # prose that ships with Python
    plain, rotated = copy.deepcopy(loaded.model), copy.deepcopy(loaded.model)
    quantize_int8(plain, rotate=False)
    quantize_int8(rotated)

    @torch.inference_mode()
    def log_probs(model: LlamaForCausalLM) -> torch.Tensor:
        return torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)

    reference = log_probs(loaded.model)

    def divergence(model: LlamaForCausalLM) -> float:
        return float((reference.exp() * (reference - log_probs(model))).sum(-1).mean())

    assert divergence(rotated) < 0.75 * divergence(plain)
