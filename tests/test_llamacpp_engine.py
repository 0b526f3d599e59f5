"""What ENGINE=llamacpp does beyond the engine contract (tests/test_engine_contract.py runs that): arrivals join a
running batch in the same decode (a mixed step), and a KV cache too small for every sequence at once puts the
youngest back in the queue, which later prefills its stream again and goes on with the same tokens."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace

from common.protocol import SamplingParams, Submit
from common.settings import Settings
from tests.conftest import run_engine

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed in this interpreter: `make llamacpp` builds it into .venv",
                allow_module_level=True)

from worker import engines
from worker.llamacpp import model as llamacpp_model
from worker.llamacpp.engine import LlamaCppEngine, build

FORCED = SamplingParams(max_tokens=60, temperature=0, top_p=1, top_k=0, ignore_eos=True)
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def small(request: pytest.FixtureRequest) -> Iterator[LlamaCppEngine]:
    """Four slots over 256 cells (llama.cpp's least): four sequences of ~20 prompt and 60 new tokens do not fit."""
    patch = pytest.MonkeyPatch()
    patch.setattr(llamacpp_model, "CELLS", 256)
    request.addfinalizer(patch.undo)
    model, engine = build(Settings(engine="llamacpp", worker_slots=4))
    yield engine
    model.library.close()


def ids(engine: LlamaCppEngine, text: str) -> list[int]:
    return engine.model.prompt_ids(Submit("p", SamplingParams(), prompt=text))


def test_an_arrival_joins_the_running_batch_in_one_decode(small: LlamaCppEngine) -> None:
    prompt = ids(small, STORY)
    small.add("a", prompt, replace(FORCED, max_tokens=6))
    steps = [small.step() for _ in range(2)]
    small.add("b", prompt[:8], replace(FORCED, max_tokens=3))  # within one chunk (PREFILL_CHUNK)
    steps.append(small.step())
    assert [step.kind for step in steps] == ["prefill", "decode", "mixed"]
    assert [out.request_id for out in steps[-1].outputs] == ["a", "b"]
    later = run_engine(small, {})
    assert (len(later["a"]), len(later["b"])) == (3, 2) and not small.has_work()


def test_a_full_cache_puts_the_youngest_back_and_every_sequence_runs_whole(small: LlamaCppEngine,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Not token for token as alone: llama.cpp's numbers depend on how many tokens a decode takes (a prompt prefilled
    with three others differs from the same prompt alone by up to 0.8 in a logit), so a readmitted sequence's
    second prefill may continue differently; its delivered tokens and indexes stand."""
    put_out: list[str] = []
    original = small._put_out
    monkeypatch.setattr(small, "_put_out", lambda sequence: (put_out.append(sequence.request_id), original(sequence)))
    prompts = {f"r{i}": ids(small, f"{STORY} {word}") for i, word in enumerate(("sailed", "sang", "slept", "swam"))}
    assert sum(len(prompt) for prompt in prompts.values()) + 4 * FORCED.max_tokens > small.library.cells
    together = run_engine(small, {0: [(rid, prompt, FORCED) for rid, prompt in prompts.items()]})
    assert put_out
    for outs in together.values():
        assert outs[-1].finish_reason == "length" and [out.index for out in outs] == list(range(FORCED.max_tokens))
        assert not any(out.error for out in outs)
    assert not small.has_work() and sorted(small.free) == [0, 1, 2, 3] and small.cache_positions == 0


def write_gemma3(path: Path) -> None:
    """A small Gemma 3 (sliding-window attention, q and k norms, norms after attention and MLP) with random weights
    and the shipped file's tokenizer, written as llama.cpp's converter would."""
    import gguf
    import numpy as np

    from worker.prompts import bundled_gguf

    shipped = gguf.GGUFReader(bundled_gguf())
    writer = gguf.GGUFWriter(str(path), "gemma3")
    width, heads, kv_heads, head, ff, layers = 64, 2, 1, 32, 128, 2
    writer.add_context_length(4096)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(32)
    for name, field in shipped.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    vocab = len(shipped.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int, norm: bool = False) -> None:
        values = np.ones(shape) if norm else rng.normal(0, 0.05, shape)
        writer.add_tensor(name, values.astype(np.float32))

    tensor("token_embd.weight", vocab, width)
    tensor("output_norm.weight", width, norm=True)
    for i in range(layers):
        for part in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensor(f"blk.{i}.{part}.weight", width, norm=True)
        tensor(f"blk.{i}.attn_q_norm.weight", head, norm=True)
        tensor(f"blk.{i}.attn_k_norm.weight", head, norm=True)
        tensor(f"blk.{i}.attn_q.weight", heads * head, width)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head, width)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head, width)
        tensor(f"blk.{i}.attn_output.weight", width, heads * head)
        tensor(f"blk.{i}.ffn_gate.weight", ff, width)
        tensor(f"blk.{i}.ffn_up.weight", ff, width)
        tensor(f"blk.{i}.ffn_down.weight", width, ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_auto_hosts_llama_cpp_for_an_architecture_the_own_kernels_do_not_serve(tmp_path: Path) -> None:
    """A Gemma 3 file under ENGINE=auto on the CPU: llama.cpp serves it (the own engine would run it in float32), and
    past its sliding window too."""
    write_gemma3(tmp_path / "model.gguf")
    model, engine = engines.build(Settings(model=str(tmp_path), model_file="model.gguf", worker_slots=2))
    try:
        assert isinstance(engine, LlamaCppEngine)
        prompt = model.prompt_ids(Submit("p", SamplingParams(), prompt=STORY))
        engine.add("a", prompt, replace(FORCED, max_tokens=48))  # beyond the 32-token window
        engine.add("b", prompt[:5], replace(FORCED, max_tokens=4))
        outputs = run_engine(engine, {})
        assert (len(outputs["a"]), len(outputs["b"])) == (48, 4)
    finally:
        model.library.close()
