"""What ENGINE=llamacpp does beyond the engine contract (tests/test_engine_contract.py runs that): arrivals join a
running batch in the same decode (a mixed step), and a KV cache too small for every sequence at once puts the
youngest back in the queue, which later prefills its stream again and goes on with the same tokens."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from msgspec.structs import replace

from common.protocol import SamplingParams, Submit
from common.settings import Settings
from tests.conftest import run_engine

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed in this interpreter: `make llamacpp` builds it into .venv",
                allow_module_level=True)

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
