"""What ENGINE=llamacpp is built from that runs without llama.cpp: the build's instruction sets named from
/proc/cpuinfo (worker/llamacpp/cmake_args.py), and the output processor every engine's text goes through
(worker/output.py) on the default model's tokenizer. The engine itself runs in tests/test_engine_contract.py."""

from __future__ import annotations

import pytest
from msgspec.structs import replace
from transformers import PreTrainedTokenizerBase

from common.protocol import SamplingParams
from worker.core import PromptTooLong
from worker.llamacpp.cmake_args import cmake_args
from worker.output import OutputProcessor
from worker.sampling import Logprobs

AVX2_HOST = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 bmi2 fma f16c\n"
AVX512_HOST = ("flags\t\t: sse4_2 avx avx2 bmi2 fma f16c avx512f avx512vbmi avx512_vnni avx512_bf16 avx_vnni "
               "amx_tile amx_int8 amx_bf16\n")
ARM_HOST = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha1 sha2 crc32 atomics fphp asimdhp\n"


def test_an_avx2_host_gets_avx2_and_no_avx512() -> None:
    args = cmake_args(AVX2_HOST)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args and "-DGGML_FMA=ON" in args
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX512_VNNI=OFF" in args and "-DGGML_AVX_VNNI=OFF" in args


def test_an_avx512_host_gets_its_sets_and_never_amx() -> None:
    args = cmake_args(AVX512_HOST)
    for option in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI"):
        assert f"-DGGML_{option}=ON" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)


def test_an_arm_host_keeps_the_native_build() -> None:
    args = cmake_args(ARM_HOST)
    assert not any(arg.startswith(("-DGGML_NATIVE", "-DGGML_AVX")) for arg in args)
    assert "-DLLAVA_BUILD=OFF" in args


@pytest.fixture(scope="module")
def processor(tokenizer: PreTrainedTokenizerBase) -> OutputProcessor:
    return OutputProcessor(tokenizer, [tokenizer.eos_token_id], 64)


FORCED = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def ids(processor: OutputProcessor, text: str) -> list[int]:
    return processor.tokenizer(text)["input_ids"]


def test_prompts_that_leave_no_room_are_refused(processor: OutputProcessor) -> None:
    with pytest.raises(PromptTooLong, match="empty"):
        processor.open("x", [], FORCED)
    with pytest.raises(PromptTooLong, match="context"):
        processor.open("x", [1] * 64, FORCED)
    with pytest.raises(PromptTooLong):
        processor.open("x", [1] * 8, FORCED, [1] * 56)


def test_text_finish_reasons_and_the_end_of_sequence(processor: OutputProcessor) -> None:
    words = ids(processor, " one two three")
    sequence = processor.open("x", ids(processor, "Count:"), replace(FORCED, max_tokens=len(words)))
    outputs = [processor.emit(sequence, token) for token in words]
    assert "".join(out.text for out in outputs) == " one two three"
    assert [out.index for out in outputs] == list(range(len(words)))
    assert [out.finish_reason for out in outputs] == [None] * (len(words) - 1) + ["length"]
    eos = processor.tokenizer.eos_token_id
    ended = processor.open("y", ids(processor, "Count:"), replace(FORCED, ignore_eos=False))
    out = processor.emit(ended, eos)
    assert (out.finish_reason, out.text) == ("stop", "")
    ignored = processor.open("z", ids(processor, "Count:"), FORCED)
    assert processor.emit(ignored, eos).finish_reason is None
    # The engine's own reason (a grammar complete) ends it too, and its token's text goes out.
    own = processor.open("g", ids(processor, "Count:"), FORCED)
    assert processor.emit(own, words[0], "stop").text == " one"


def test_the_context_ends_a_sequence(processor: OutputProcessor) -> None:
    sequence = processor.open("x", [1] * 62, replace(FORCED, max_tokens=100))
    assert processor.emit(sequence, 5).finish_reason is None
    assert processor.emit(sequence, 5).finish_reason == "length"


def test_stop_strings_wait_for_min_tokens_and_are_held_back(processor: OutputProcessor) -> None:
    words = ids(processor, " red blue red blue")
    params = replace(FORCED, max_tokens=20, stop=("red",), min_tokens=2)
    sequence = processor.open("x", ids(processor, "Colours:"), params)
    outputs = []
    for token in words:
        outputs.append(processor.emit(sequence, token))
        if outputs[-1].finish_reason:
            break
    # The first "red" is within min_tokens; the second ends the text right before it.
    assert "".join(out.text for out in outputs) == " red blue "
    assert outputs[-1].finish_reason == "stop"


def test_a_resumed_sequence_continues_its_held_text_exactly(processor: OutputProcessor) -> None:
    words = ids(processor, " alpha beta gamma delta")
    params = replace(FORCED, max_tokens=20, stop=("gamma!",))
    prompt = ids(processor, "Greek:")
    whole = processor.open("x", prompt, params)
    texts = [processor.emit(whole, token).text for token in words]
    resumed = processor.open("x", prompt, params, words[:3])
    assert resumed.tokens == words[:3]
    assert [processor.emit(resumed, token).text for token in words[3:]] == texts[3:]
    assert processor.emit(resumed, 5).index == len(words)


def test_logprobs_become_text(processor: OutputProcessor) -> None:
    ranked = Logprobs(-0.5, ids(processor, " yes no")[-2:], [-0.5, -1.5])
    sequence = processor.open("x", ids(processor, "Answer:"), FORCED)
    out = processor.emit(sequence, ranked.top_ids[0], logprobs=ranked)
    assert out.logprob.logprob == -0.5 and [entry.logprob for entry in out.top_logprobs] == [-0.5, -1.5]
    assert out.top_logprobs[0].token == out.logprob.token
