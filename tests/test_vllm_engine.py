"""ENGINE=vllm's pure parts, without vLLM: how our requests become vLLM's sampling fields and grammars, which
engine `auto` picks, vLLM's engine arguments from our settings, and what the gateway refuses for a vLLM worker.
The engine itself runs in tests/test_engine_contract.py and tests/test_vllm_stack.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
from llguidance import LLMatcher

from common import grammar as grammars
from common import toolcalls
from common.protocol import SamplingParams, Tool
from common.settings import Settings, SettingsError
from gateway.engine_limits import refusal
from gateway.schemas import GenerateRequest
from worker.engines import choose, gguf_architecture
from worker.vllm import DELIVERED
from worker.vllm import model as vllm_model
from worker.vllm.sampling import as_lark, ranked, resumed_biases, sampling_arguments

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def accepts(grammar: str, text: str) -> bool:
    """Whether `text` is a whole answer of the Lark `grammar`, by llguidance on bytes."""
    matcher = LLMatcher(grammars._BYTES or _bytes(), LLMatcher.grammar_from_lark(grammar), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def _bytes():
    grammars.probe(grammars.regex("a"))  # builds the byte tokenizer common/grammar.py keeps
    return grammars._BYTES


@pytest.mark.parametrize(("built", "good", "bad"), [
    (grammars.json_schema(SCHEMA), '{"city": "Paris"}', '{"city":"Paris"}'),
    (grammars.regex("[a-z]+ [0-9]"), "abc 7", "abc7"),
    (grammars.choice(["yes", "no"]), "no", "maybe"),
    (grammars.lark('start: "a" "b"+'), "abbb", "ba"),
])
def test_the_gateways_grammars_keep_their_language_as_lark_for_vllm(built: str, good: str, bad: str) -> None:
    lark = as_lark(built)
    assert not lark.lstrip().startswith("{")
    assert accepts(lark, good) and not accepts(lark, bad)


def test_a_tool_call_grammar_passes_as_it_is() -> None:
    tools = [Tool("weather", "", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))]
    built = toolcalls.grammar(tools, None, True, False)
    assert as_lark(built) == built
    assert accepts(as_lark(built), '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def test_a_grammar_vllm_cannot_take_is_a_grammar_error() -> None:
    with pytest.raises(grammars.GrammarError):
        as_lark('{"grammars": [{"lark_grammar": "start: a"}, {"lark_grammar": "start: b"}]}')
    with pytest.raises(grammars.GrammarError):
        as_lark('{"grammars": 3}')


def test_a_ban_is_minus_infinity_and_delivered_tokens_carry_their_penalties() -> None:
    params = SamplingParams(logit_bias=((5, -100.0), (6, 2.5)), frequency_penalty=0.5, presence_penalty=0.25)
    biases = resumed_biases(params, [6, 6, 7])
    assert biases == {5: float("-inf"), 6: 2.5 - 2 * 0.5, 7: -0.5}
    assert resumed_biases(SamplingParams(), [1, 2]) == {}
    assert sampling_arguments(params, [6, 6, 7])["extra_args"] == {DELIVERED: [6, 6, 7]}
    assert "extra_args" not in sampling_arguments(params, []) and "extra_args" not in sampling_arguments(
        SamplingParams(frequency_penalty=1.0), [6])


def test_without_a_processor_the_delivered_presence_penalty_is_a_bias() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    assert resumed_biases(params, [6, 6, 7], exact_presence=False) == {6: -2 * 0.5 - 0.25, 7: -0.5 - 0.25}
    assert "extra_args" not in sampling_arguments(params, [6, 6, 7], exact_presence=False)


def test_a_resumed_constrained_request_carries_its_tokens_for_the_grammar_replay() -> None:
    constrained = SamplingParams(grammar=grammars.regex("[a-z]+"))
    assert sampling_arguments(constrained, [4, 5])["extra_args"] == {DELIVERED: [4, 5]}
    assert "extra_args" not in sampling_arguments(constrained, [])


def test_a_resumed_request_asks_vllm_for_what_is_left() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=6, top_k=-1, temperature=0, seed=3, logprobs=2)
    arguments = sampling_arguments(params, [1, 2, 3, 4])
    assert arguments["max_tokens"] == 6 and arguments["min_tokens"] == 2
    assert arguments["top_k"] == 0 and arguments["seed"] == 3 and arguments["logprobs"] == 2
    assert arguments["n"] == 1 and arguments["detokenize"] is False
    assert "logit_bias" not in arguments
    assert sampling_arguments(SamplingParams(max_tokens=3, min_tokens=9), [])["min_tokens"] == 3


def test_vllm_log_probabilities_reach_the_output_processor_in_rank_order() -> None:
    """vLLM's Logprob per token id (rank, logprob), the chosen token added when it is not among the top ones."""
    def rank(order: int | None, value: float) -> SimpleNamespace:
        return SimpleNamespace(rank=order, logprob=value)

    position = {7: rank(3, -2.5), 4: rank(1, -0.25), 9: rank(2, -1.0), 5: rank(None, -9.0)}
    picked = ranked(7, position, 2)
    assert (picked.chosen, picked.top_ids, picked.top_values) == (-2.5, [4, 9], [-0.25, -1.0])
    assert ranked(4, position, 5).top_ids == [4, 9, 7]


def test_auto_picks_vllm_only_with_a_gpu_and_vllm_installed() -> None:
    assert choose("auto", cuda=True, vllm_installed=True) == "vllm"
    assert choose("auto", cuda=True, vllm_installed=False) == "hf"
    assert choose("auto", cuda=False, vllm_installed=True) == "hf"
    assert choose("vllm", cuda=False, vllm_installed=True) == "vllm"
    assert choose("sim", cuda=True, vllm_installed=True) == "sim"


def test_auto_hosts_llama_cpp_for_a_gguf_architecture_the_own_kernels_do_not_serve() -> None:
    assert choose("auto", False, False, "gemma3", llamacpp_installed=True) == "llamacpp"
    assert choose("auto", False, False, "phi3", llamacpp_installed=True) == "llamacpp"
    assert choose("auto", False, False, "gemma3", llamacpp_installed=False) == "hf"  # warned at load (paths.py)
    for own in ("llama", "qwen2", "qwen3"):
        assert choose("auto", False, False, own, llamacpp_installed=True) == "hf"
    assert choose("auto", False, False, None, llamacpp_installed=True) == "hf"  # a transformers folder
    assert choose("auto", True, True, "gemma3", llamacpp_installed=True) == "vllm"
    assert choose("hf", False, False, "gemma3", llamacpp_installed=True) == "hf"


def test_the_architecture_is_read_from_the_file_s_header(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(Settings(model=str(tmp_path), model_file="model.gguf")) == "gemma3"
    assert gguf_architecture(Settings(model=str(tmp_path), model_file="absent.gguf")) is None


def test_vllm_engine_arguments_follow_our_settings() -> None:
    settings = Settings(worker_slots=24, vllm_max_model_len=4096, vllm_kv_cache_gb=3, vllm_tensor_parallel_size=2,
                        vllm_gpu_memory_utilization=0.8, prefix_cache_bytes="0")
    gpu = vllm_model.engine_arguments(settings, "/m", cuda=True)
    assert gpu["max_num_seqs"] == 24 and gpu["max_model_len"] == 4096 and gpu["tensor_parallel_size"] == 2
    assert gpu["gpu_memory_utilization"] == 0.8 and gpu["kv_cache_memory_bytes"] == 3 << 30
    assert gpu["dtype"] == "bfloat16" and gpu["enforce_eager"] is False and gpu["enable_prefix_caching"] is False
    assert gpu["structured_outputs_config"] == {"backend": "guidance"}
    cpu = vllm_model.engine_arguments(Settings(), "/m", cuda=False)
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] is True and "max_model_len" not in cpu
    assert "max_num_seqs" not in cpu and "gpu_memory_utilization" not in cpu  # 0: what `vllm serve` picks
    assert "kv_cache_memory_bytes" not in cpu and cpu["enable_prefix_caching"] is True
    assert vllm_model.enforce_eager("off", cuda=False) is False and vllm_model.enforce_eager("on", cuda=True)
    assert vllm_model.dtype("float16", cuda=False) == "float16"


def test_vllm_on_cpu_gets_a_bounded_kv_cache_and_the_workers_threads() -> None:
    assert vllm_model.cpu_environment(Settings(worker_threads=3)) == {
        "VLLM_CPU_KVCACHE_SPACE": str(vllm_model.CPU_KV_CACHE_GB), "OMP_NUM_THREADS": "3"}
    assert vllm_model.cpu_environment(Settings(vllm_kv_cache_gb=5, worker_threads=1))["VLLM_CPU_KVCACHE_SPACE"] == "5"


@pytest.mark.parametrize(("name", "value"), [("ENGINE", "tensorrt"), ("VLLM_ENFORCE_EAGER", "yes"),
                                             ("VLLM_GPU_MEMORY_UTILIZATION", "1.5"),
                                             ("VLLM_TENSOR_PARALLEL_SIZE", "0"),
                                             ("VLLM_ENGINE_ARGS", "--dtype 'half")])
def test_a_bad_vllm_setting_fails_at_start_naming_it(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        Settings.from_env()


def test_a_converted_model_is_named_by_its_file_and_written_again_when_it_changes(tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"one")
    first = vllm_model.converted_dir(str(gguf), str(tmp_path / "cache"))
    os.utime(gguf, ns=(1, 1))
    assert vllm_model.converted_dir(str(gguf), str(tmp_path / "cache")) != first
    assert os.path.basename(first).startswith("model-")
    bf16 = vllm_model.converted_dir(str(gguf), str(tmp_path / "cache"), "bfloat16")
    assert bf16.endswith("-bfloat16") and bf16 != vllm_model.converted_dir(str(gguf), str(tmp_path / "cache"))
    assert vllm_model.hf_directory(Settings(model="org/some-model")) == "org/some-model"


def test_the_gateway_refuses_what_a_vllm_worker_cannot_do_naming_the_field() -> None:
    hot = GenerateRequest(prompt="x", temperature=3.0)
    error = refusal({"vllm", "hf"}, hot)
    assert error is not None and error.status == 400 and error.param == "temperature"
    assert "2" in error.message
    assert refusal({"hf", "sim", ""}, hot) is None
    assert refusal({"vllm"}, GenerateRequest(prompt="x", temperature=2.0)) is None


def test_the_heartbeat_reads_vllms_prefix_report_without_touching_its_block_pool() -> None:
    from common.prefix_keys import TextPrefix
    from worker.vllm.engine import VllmPrefixes

    class Pool:
        def __init__(self) -> None:
            self.calls = 0

        def get_cached_block(self, digest: bytes, groups: list[int]) -> object:
            self.calls += 1
            return object()

    pool = Pool()
    prefixes = VllmPrefixes(lambda: [b"a", b"b", b"c", b"d"], pool, 4)
    prefixes.remember([TextPrefix(7, 1.0)], list(range(16)))
    assert prefixes.held() == [] and pool.calls == 0  # the heartbeat thread: the loop's last answer only
    prefixes.refresh(at=100.0)
    assert prefixes.held() == [7] and pool.calls == 1
    prefixes.refresh(at=100.1)  # sooner than REFRESH_S: no second look
    assert pool.calls == 1
