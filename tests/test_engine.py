"""The continuous-batching engine on the real default model, in-process."""

from __future__ import annotations

import pytest

from common.protocol import SamplingParams
from tests.conftest import run_engine
from worker.core import PromptTooLong
from worker.detokenizer import Detokenizer
from worker.own.engine import Engine
from worker.own.model import LoadedModel

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = {
    "a": "The quick brown",
    "b": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "c": "Paris is",
}


def run(engine: Engine, arrivals: dict[int, list[tuple[str, SamplingParams]]]) -> dict[str, list[int]]:
    """Step the engine, adding each (prompt key, params) at its step; returns each request's tokens."""
    prompts = {step: [(key, engine.loaded.tokenizer(PROMPTS[key])["input_ids"], params) for key, params in added]
               for step, added in arrivals.items()}
    return {key: [out.token_id for out in outs] for key, outs in run_engine(engine, prompts).items()}


def solo(loaded: LoadedModel, key: str, params: SamplingParams = GREEDY) -> list[int]:
    return run(Engine(loaded, 16), {0: [(key, params)]})[key]


def test_joining_and_leaving_does_not_change_a_greedy_completion(loaded: LoadedModel) -> None:
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    mixed = run(Engine(loaded, 16), {0: [("a", GREEDY)], 3: [("b", GREEDY), ("c", short)]})
    assert mixed["a"] == solo(loaded, "a")
    assert mixed["b"] == solo(loaded, "b")
    assert mixed["c"] == solo(loaded, "c")[:3]


def test_a_newcomer_joins_the_running_batch_and_a_finished_one_leaves_at_once(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16)
    tokenizer = loaded.tokenizer
    engine.add("a", tokenizer(PROMPTS["a"])["input_ids"], GREEDY)
    engine.step()
    engine.step()
    engine.add("c", tokenizer(PROMPTS["c"])["input_ids"], SamplingParams(max_tokens=2, temperature=0))
    first = engine.step()  # the newcomer's prefill rides in "a"'s decode step: nothing waits or restarts
    assert first.kind == "mixed" and [o.request_id for o in first.outputs] == ["a", "c"]
    assert [s.request_id for s in engine.running] == ["a", "c"]
    second = engine.step().outputs  # one decode for both rows
    assert sorted(o.request_id for o in second) == ["a", "c"]
    assert [s.request_id for s in engine.running] == ["a"]
    assert engine.batch.mask.shape[0] == 1


def test_a_long_sequence_leaving_trims_the_padding(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16)
    tokenizer = loaded.tokenizer
    engine.add("b", tokenizer(PROMPTS["b"])["input_ids"], SamplingParams(max_tokens=2, temperature=0))
    engine.add("a", tokenizer(PROMPTS["a"])["input_ids"], GREEDY)
    while "b" in [s.request_id for s in engine.running] or engine.waiting:
        engine.step()
    a = engine.running[0]
    assert engine.batch.mask.shape[1] == len(a.prompt_ids) + len(a.output_ids) - 1
    assert bool(engine.batch.mask.all())


def test_cancel_removes_a_sequence_between_steps(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16)
    for key in ("a", "c"):
        engine.add(key, loaded.tokenizer(PROMPTS[key])["input_ids"], GREEDY)
    engine.step()
    assert engine.cancel("c")
    assert not engine.cancel("c")
    rest = [out.token_id for _ in range(15) for out in engine.step().outputs]
    assert [s.request_id for s in engine.running] == []
    assert rest == solo(loaded, "a")[1:]


def test_slots_bound_the_running_batch(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 2)
    for key in ("a", "b", "c"):
        engine.add(key, loaded.tokenizer(PROMPTS[key])["input_ids"], GREEDY)
    engine.step()
    assert len(engine.running) + len(engine.prefilling) == 2  # admitted: running, or its prompt in prefill
    assert len(engine.waiting) == 1


def test_seeded_sampling_repeats_and_does_not_depend_on_batch_mates(loaded: LoadedModel) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    alone = solo(loaded, "a", seeded)
    assert alone == solo(loaded, "a", seeded)
    mixed = run(Engine(loaded, 16), {0: [("b", seeded)], 1: [("a", seeded), ("c", SamplingParams(seed=5))]})
    assert mixed["a"] == alone


def test_finish_reasons(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 4)
    chat = loaded.chat_ids([{"role": "user", "content": "Say hi."}])
    engine.add("chat", chat, SamplingParams(max_tokens=200, temperature=0))
    engine.add("short", loaded.tokenizer("Hello")["input_ids"], SamplingParams(max_tokens=2, temperature=0))
    reasons = {key: outs[-1].finish_reason for key, outs in run_engine(engine, {}).items()}
    assert reasons == {"chat": "stop", "short": "length"}


def test_a_prompt_longer_than_the_context_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(PromptTooLong, match="context"):
        Engine(loaded, 4).add("x", [1] * loaded.max_length, GREEDY)


def test_detokenizer_never_emits_a_split_character(loaded: LoadedModel) -> None:
    text = "Café 日本語 🎉🚀 naïve — ok"
    ids = loaded.tokenizer(text)["input_ids"]
    prompt = loaded.tokenizer("Say:")["input_ids"]
    detokenizer = Detokenizer(loaded.tokenizer, prompt)
    deltas = [detokenizer.push(i) for i in ids]
    assert "".join(deltas) == loaded.tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some character did span several tokens


def test_static_batching_admits_a_batch_only_when_the_last_one_has_finished(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16, static=True)
    tokenizer = loaded.tokenizer
    engine.add("a", tokenizer(PROMPTS["a"])["input_ids"], SamplingParams(max_tokens=3, temperature=0,
                                                                          ignore_eos=True))
    engine.step()
    engine.add("c", tokenizer(PROMPTS["c"])["input_ids"], GREEDY)
    served = [[o.request_id for o in engine.step().outputs] for _ in range(3)]
    assert served == [["a"], ["a"], ["c"]]  # "c" waits out "a" although slots are free
    assert len(run(engine, {})["c"]) == GREEDY.max_tokens - 1  # then runs to its end alone


def test_a_resumed_sequence_continues_exactly_as_it_would_have(loaded: LoadedModel) -> None:
    whole = solo(loaded, "b")
    engine = Engine(loaded, 16)
    engine.add("b", engine.loaded.tokenizer(PROMPTS["b"])["input_ids"], GREEDY, resume=whole[:6])
    rest = run(engine, {0: [("a", GREEDY)]})  # with a batch-mate joining in the same prefill
    assert rest["b"] == whole[6:]
    assert rest["a"] == solo(loaded, "a")


def test_a_row_that_cannot_be_sampled_fails_alone_and_its_batch_mates_go_on(loaded: LoadedModel) -> None:
    # The gateway refuses a NaN penalty; here it stands for any value that makes one row's sampling raise
    # (from its second token on). Its batch-mates must finish exactly as they would alone.
    broken = SamplingParams(max_tokens=16, temperature=1.0, frequency_penalty=float("nan"), ignore_eos=True)
    huge_k = SamplingParams(max_tokens=4, temperature=1.0, top_k=2**63 - 1, seed=3, ignore_eos=True)
    engine = Engine(loaded, 16)
    for key, params in (("a", GREEDY), ("b", broken), ("c", huge_k)):
        engine.add(key, loaded.tokenizer(PROMPTS[key])["input_ids"], params)
    outputs = run_engine(engine, {})
    errors = {key: out.error for key, outs in outputs.items() for out in outs if out.error}
    tokens = {key: [out.token_id for out in outs if not out.error] for key, outs in outputs.items()}
    assert list(errors) == ["b"] and len(tokens["b"]) == 1
    assert tokens["a"] == solo(loaded, "a")
    assert len(tokens["c"]) == 4  # a top_k past the vocabulary means the whole vocabulary
