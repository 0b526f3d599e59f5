"""The int8 CPU path (worker/weights/quant.py): accuracy and batch invariance of the layer, and the real default
model loaded with WORKER_QUANT=int8, in-process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from common.protocol import SamplingParams
from common.settings import Settings
from tests.conftest import run_engine
from worker.own.engine import Engine
from worker.own.model import LoadedModel, load_model
from worker.own.sequences import left_padded
from worker.weights.quant import ROWWISE_ATTENTION, Int8Linear, Int8LlamaLayer, quantize_int8

QUESTIONS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
             "Name three primary colors."]


@pytest.fixture(scope="module")
def loaded(int8_loaded: LoadedModel) -> LoadedModel:
    return int8_loaded


def chat(loaded: LoadedModel, question: str) -> list[int]:
    return loaded.chat_ids([{"role": "user", "content": question}])


def layer(in_features: int = 576, out_features: int = 1536, bias: bool = True) -> tuple[nn.Linear, Int8Linear]:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    return linear, Int8Linear(linear)


def test_the_int8_layer_is_close_to_the_float_one() -> None:
    linear, int8 = layer()
    x = torch.randn(32, 576)
    with torch.no_grad():
        error = (int8(x) - linear(x)).norm() / linear(x).norm()
    assert error < 0.03  # 7-bit weights, 8-bit activations: about 1.1% here


def test_a_row_gives_the_same_bits_alone_and_among_very_different_rows() -> None:
    torch.manual_seed(1)
    for in_features, out_features in ((576, 1536), (1536, 576), (100, 37)):
        _, int8 = layer(in_features, out_features)
        rows = torch.randn(40, in_features) * torch.logspace(-4, 4, 40)[:, None]  # magnitudes 1e-4 .. 1e4
        rows[7, 3] = 1e6  # an outlier that would dominate a shared (per-tensor) scale
        alone = [int8(rows[i:i + 1]) for i in range(40)]
        for size in (2, 5, 16, 17, 40):
            picked = torch.randperm(40)[:size]
            together = int8(rows[picked])
            assert all(torch.equal(together[j:j + 1], alone[i]) for j, i in enumerate(picked.tolist()))
        # a [batch, tokens, features] input: the same bits per token
        assert torch.equal(int8(rows[:6].view(2, 3, in_features))[1, 2], alone[5][0])


def test_edge_rows_and_dtypes() -> None:
    linear, int8 = layer(bias=True)
    assert torch.equal(int8(torch.zeros(2, 576)), linear.bias.detach().expand(2, -1))  # a zero row: no NaN
    half = nn.Linear(576, 64).to(torch.bfloat16)
    assert Int8Linear(half)(torch.randn(3, 576, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_quantize_int8_swaps_every_linear_of_a_module() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    assert quantize_int8(model) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear)
    assert model(torch.randn(5, 8)).shape == (5, 4)


def test_fused_llama_layers_give_the_same_bits_as_one_int8_linear_per_projection() -> None:
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    fused, separate = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    separate.load_state_dict(fused.state_dict())
    assert quantize_int8(fused, rotate=False) == 7 * 2 + 1  # the rotation has tests of its own
    assert all(isinstance(layer, Int8LlamaLayer) for layer in fused.model.layers)
    for parent, name, child in [(p, n, c) for p in separate.modules() for n, c in p.named_children()]:
        if isinstance(child, nn.Linear):
            setattr(parent, name, Int8Linear(child))
    separate.set_attn_implementation(ROWWISE_ATTENTION)
    ids = torch.randint(0, 300, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row

    @torch.inference_mode()
    def prefill_and_step(model: LlamaForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
        cache = DynamicCache(config=config)
        prefill = model(input_ids=ids, attention_mask=mask, cache=cache).logits
        return prefill, model(input_ids=ids[:, :1], attention_mask=F.pad(mask, [0, 1], value=1), cache=cache).logits

    assert all(torch.equal(a, b) for a, b in zip(prefill_and_step(fused), prefill_and_step(separate), strict=True))


def test_load_model_int8_swaps_the_decoder_linears_and_the_lm_head(loaded: LoadedModel) -> None:
    model = loaded.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    layers = model.config.num_hidden_layers
    assert all(isinstance(layer, Int8LlamaLayer) for layer in model.model.layers)
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * layers + 1  # q, k, v and gate, up fused
    assert isinstance(model.lm_head, Int8Linear)
    assert model.get_input_embeddings().weight.dtype == torch.float32  # the lookup stays float
    assert model.config._attn_implementation == ROWWISE_ATTENTION


def test_the_int8_model_still_answers(loaded: LoadedModel) -> None:
    # int8 moves logits by about one unit against fp32, enough to flip a near-tie of fp32's (the chat
    # answer to QUESTIONS[0] starts "The" or "L'Étoile" by 0.1); this answer leads by 2.4.
    ids = torch.tensor([loaded.tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                    do_sample=False, pad_token_id=loaded.eos_token_ids[0])
    assert loaded.tokenizer.decode(out[0, ids.shape[1]:]).startswith(" Paris")


def shaped(prompts: list[list[int]], lengths: str) -> list[list[int]]:
    """`different` as given; `equal`: cut to one length (no padding); `runs`: the first two cut to one length
    shorter than the third (neighbours that share an attention call, in a padded batch)."""
    shortest = min(map(len, prompts))
    if lengths == "equal":
        return [p[:shortest] for p in prompts]
    if lengths == "runs":
        return [p[:shortest - 1] for p in prompts[:2]] + prompts[2:]
    return prompts


@pytest.mark.parametrize("lengths", ["different", "equal", "runs"])
def test_a_batch_gives_each_prompt_its_solo_logits_bit_for_bit(loaded: LoadedModel, lengths: str) -> None:
    prompts = shaped([chat(loaded, q) for q in QUESTIONS], lengths)
    ids, mask = left_padded(prompts, loaded.eos_token_ids[0])
    with torch.inference_mode():
        together = loaded.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                                logits_to_keep=1).logits[:, -1]
        for row, prompt in enumerate(prompts):
            alone = loaded.model(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[:, -1]
            assert torch.equal(together[row:row + 1], alone)


@pytest.mark.parametrize("lengths", ["different", "equal", "runs"])
def test_greedy_completions_through_the_engine_do_not_depend_on_batch_mates(loaded: LoadedModel,
                                                                            lengths: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def complete(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        outputs = run_engine(Engine(loaded, 16), {0: [(key, prompt, params) for key, prompt in prompts.items()]})
        return {key: [out.token_id for out in outs] for key, outs in outputs.items()}

    prompts = dict(zip(QUESTIONS, shaped([chat(loaded, q) for q in QUESTIONS], lengths), strict=True))
    together = complete(prompts)
    assert all(together[q] == complete({q: prompts[q]})[q] for q in QUESTIONS)


def test_a_migrated_request_continues_exactly_as_it_would_have(loaded: LoadedModel) -> None:
    """Another worker takes over the tokens already delivered (the engine replays them as decode steps):
    any last-bit difference from the lost worker's computation would, through int8, change the text."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def complete(prompt: list[int], resume: list[int] | None = None) -> list[int]:
        outputs = run_engine(Engine(loaded, 16), {0: [("x", prompt, params, resume)]})["x"]
        return [*(resume or []), *(out.token_id for out in outputs)]

    for question in QUESTIONS:
        prompt = chat(loaded, question)
        uninterrupted = complete(prompt)
        assert complete(prompt, resume=uninterrupted[:5]) == uninterrupted


def test_an_unknown_worker_quant_fails_clearly() -> None:
    with pytest.raises(ValueError, match="WORKER_QUANT must be auto, gguf, int8 or none, not 'int4'"):
        load_model(Settings(worker_quant="int4"))


def test_int8_on_cuda_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        load_model(Settings(worker_quant="int8", worker_device="cuda"))
