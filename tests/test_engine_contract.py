"""The engine contract: what the worker loop (worker/main.py) relies on from any engine behind worker/core.py's
seam, run against each engine on the real default model. A new engine (SGLang, ...) joins by adding a case to
ENGINES and passing this module.

- hf: the own engine (worker/own/engine.py), on the model as a worker loads it;
- vllm: vLLM's engine in-process (worker/vllm/engine.py), eager, a small context, one start for the module; it
  runs where vLLM is installed: `make test` runs these cases with .venv-vllm's pytest (`-m vllm`);
- llamacpp: llama.cpp's library hosted in-process (worker/llamacpp/engine.py) on the default model's GGUF file; it
  runs where llama-cpp-python is installed (`make test` builds it into .venv: `make llamacpp`);
- sim: the control-plane stand-in (worker/sim.py), for the parts of the contract it keeps (no model).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from msgspec.structs import replace

from common import grammar as grammars
from common.protocol import ChatMessage, Detokenize, SamplingParams, Submit, Tokenize
from common.settings import Settings
from tests.conftest import run_engine
from worker.core import Engine, GrammarError, Model, PromptTooLong, StepOutput

# What vLLM runs with here: small and eager, so that one start takes seconds, not minutes.
VLLM_SETTINGS = {"engine": "vllm", "vllm_max_model_len": 1024, "vllm_kv_cache_gb": 1.0, "worker_slots": 8}
GREEDY = SamplingParams(max_tokens=16, temperature=0, top_p=1, top_k=0)
FORCED = replace(GREEDY, ignore_eos=True)
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
LOOP = "one two one two one two one two one two"
FOX = "The quick brown fox jumps over the lazy dog. The quick brown fox"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "maximum": 100000000}},
          "required": ["city", "population"]}
# Cases marked `model_feature` need a model, which ENGINE=sim has not: tests/conftest.py deselects them for sim,
# as it deselects vLLM's cases where vLLM is not installed (never skips: a skip in a green run stands out).


@dataclass
class Subject:
    kind: str
    model: Model
    engine: Engine

    def ids(self, text: str) -> list[int]:
        return self.model.prompt_ids(Submit("p", SamplingParams(), prompt=text))

    def run(self, arrivals: dict[int, list]) -> dict[str, list[StepOutput]]:
        outputs = run_engine(self.engine, arrivals)
        assert not self.engine.has_work() and self.engine.running_count == self.engine.waiting_count == 0
        return outputs

    def alone(self, text: str, params: SamplingParams, resume: list[int] | None = None) -> list[StepOutput]:
        return self.run({0: [("x", self.ids(text), params, resume)]})["x"]


def _hf(request: pytest.FixtureRequest) -> Iterator[Subject]:
    from worker.own.engine import Engine as OwnEngine

    loaded = request.getfixturevalue("loaded")  # the session's model (tests/conftest.py)
    yield Subject("hf", loaded, OwnEngine(loaded, 8))


def _vllm(_request: pytest.FixtureRequest) -> Iterator[Subject]:
    from worker.vllm.engine import build

    model, engine = build(Settings(**VLLM_SETTINGS))
    yield Subject("vllm", model, engine)
    engine.abort_all()
    del engine.llm  # vLLM's engine core lives in this process: let it go before the next module


def _llamacpp(_request: pytest.FixtureRequest) -> Iterator[Subject]:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed in this interpreter: `make llamacpp` builds it into .venv "
                    "(`make test` does)")
    from worker.llamacpp.engine import build

    model, engine = build(Settings(engine="llamacpp", worker_slots=8))
    yield Subject("llamacpp", model, engine)
    engine.abort_all()
    model.library.close()


def _sim(_request: pytest.FixtureRequest) -> Iterator[Subject]:
    from worker.sim import SimEngine, SimModel

    model = SimModel()
    yield Subject("sim", model, SimEngine(model, 8, 0, 0))


ENGINES = {"hf": _hf, "vllm": _vllm, "llamacpp": _llamacpp, "sim": _sim}


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm), "llamacpp", "sim"])
def subject(request: pytest.FixtureRequest) -> Iterator[Subject]:
    yield from ENGINES[request.param](request)


def tokens(outputs: list[StepOutput]) -> list[int]:
    return [out.token_id for out in outputs]


def text(outputs: list[StepOutput]) -> str:
    return "".join(out.text for out in outputs)


def check_whole(outputs: list[StepOutput], first: int = 0) -> None:
    """Indexes contiguous from `first`, no error, and exactly one finish, on the last."""
    assert [out.index for out in outputs] == list(range(first, first + len(outputs)))
    assert not any(out.error for out in outputs)
    assert [out.finish_reason is not None for out in outputs] == [False] * (len(outputs) - 1) + [True]


# -- every engine


def test_indexes_are_contiguous_and_max_tokens_ends_with_length(subject: Subject) -> None:
    outputs = subject.alone(STORY, replace(FORCED, max_tokens=9))
    check_whole(outputs)
    assert len(outputs) == 9 and outputs[-1].finish_reason == "length"
    assert {out.prompt_tokens for out in outputs} == {len(subject.ids(STORY))}


def test_requests_arriving_at_different_steps_each_run_whole(subject: Subject) -> None:
    ids = subject.ids(STORY)
    later = [("b", ids, replace(FORCED, max_tokens=4)), ("c", ids[:5], replace(FORCED, max_tokens=3))]
    outputs = subject.run({0: [("a", ids, replace(FORCED, max_tokens=6))], 2: later})
    assert {rid: len(outs) for rid, outs in outputs.items()} == {"a": 6, "b": 4, "c": 3}
    for outs in outputs.values():
        check_whole(outs)


def test_cancel_stops_one_request_and_the_others_go_on(subject: Subject) -> None:
    engine, ids = subject.engine, subject.ids(STORY)
    engine.add("gone", ids, replace(FORCED, max_tokens=12))
    engine.add("kept", ids, replace(FORCED, max_tokens=6))
    seen: dict[str, list[StepOutput]] = {}
    for _ in range(2):
        for out in engine.step().outputs:
            seen.setdefault(out.request_id, []).append(out)
    assert engine.request_ids() == {"gone", "kept"}
    assert engine.cancel("gone") and not engine.cancel("gone") and not engine.cancel("never-added")
    assert engine.request_ids() == {"kept"}
    after = subject.run({})
    assert "gone" not in after
    check_whole(seen.get("kept", []) + after["kept"])


def test_abort_all_forgets_every_request(subject: Subject) -> None:
    engine, ids = subject.engine, subject.ids(STORY)
    for name in ("a", "b", "c"):
        engine.add(name, ids, replace(FORCED, max_tokens=8))
    engine.step()
    assert sorted(engine.abort_all()) == ["a", "b", "c"]
    assert not engine.has_work() and engine.running_count == engine.waiting_count == 0 and not engine.request_ids()
    assert engine.step().outputs == []


def test_a_prompt_that_does_not_fit_the_context_is_refused(subject: Subject) -> None:
    with pytest.raises(PromptTooLong):
        subject.engine.add("long", [1] * subject.model.max_length, GREEDY)
    with pytest.raises(PromptTooLong):
        subject.engine.add("resumed", [1] * 8, GREEDY, [1] * subject.model.max_length)
    assert not subject.engine.has_work()


def test_slots_and_counts_say_what_the_engine_holds(subject: Subject) -> None:
    engine, ids = subject.engine, subject.ids(STORY)
    assert engine.slots >= 1
    engine.add("a", ids, replace(FORCED, max_tokens=4))
    engine.add("b", ids, replace(FORCED, max_tokens=4))
    assert engine.has_work() and engine.running_count + engine.waiting_count == 2
    assert engine.request_ids() == {"a", "b"}  # waiting or prefilling: held all the same
    subject.run({})
    assert engine.request_ids() == set()


def test_a_resumed_request_continues_from_the_delivered_tokens(subject: Subject) -> None:
    whole = subject.alone(STORY, FORCED)
    delivered = tokens(whole)[:5]
    rest = subject.alone(STORY, FORCED, delivered)
    check_whole(rest, first=5)
    assert tokens(rest) == tokens(whole)[5:]
    assert rest[-1].finish_reason == "length"


def test_a_request_whose_tokens_were_all_delivered_needs_no_new_one(subject: Subject) -> None:
    """max_tokens counts the delivered tokens too: one left means exactly one more."""
    whole = subject.alone(STORY, replace(FORCED, max_tokens=6))
    rest = subject.alone(STORY, replace(FORCED, max_tokens=6), tokens(whole)[:5])
    assert [(out.index, out.finish_reason) for out in rest] == [(5, "length")]


# -- engines with a model


@pytest.mark.model_feature("text")
def test_greedy_text_repeats_and_joins_its_deltas(subject: Subject) -> None:
    first, second = subject.alone(STORY, FORCED), subject.alone(STORY, FORCED)
    assert tokens(first) == tokens(second) and text(first) == text(second)
    assert text(first).strip() and text(first) == subject.model.answer(Detokenize("d", tokens(first))).text


@pytest.mark.model_feature("text")
def test_the_end_of_sequence_ends_a_request_with_stop_unless_ignored(subject: Subject) -> None:
    chat = subject.model.prompt_ids(Submit("c", GREEDY, messages=[ChatMessage("user", "Say hi.")]))
    ended = subject.run({0: [("x", chat, replace(GREEDY, max_tokens=200))]})["x"]
    check_whole(ended)
    assert ended[-1].finish_reason == "stop" and ended[-1].token_id in subject.model.eos_token_ids
    assert ended[-1].text == ""
    forced = subject.run({0: [("x", chat, replace(FORCED, max_tokens=len(ended) + 3))]})["x"]
    assert len(forced) == len(ended) + 3 and forced[-1].finish_reason == "length"


@pytest.mark.model_feature("text")
def test_min_tokens_holds_off_the_end_of_sequence(subject: Subject) -> None:
    chat = subject.model.prompt_ids(Submit("c", GREEDY, messages=[ChatMessage("user", "Say hi.")]))
    ended = subject.run({0: [("x", chat, replace(GREEDY, max_tokens=200))]})["x"]
    longer = subject.run({0: [("x", chat, replace(GREEDY, max_tokens=200, min_tokens=len(ended) + 2))]})["x"]
    check_whole(longer)
    assert len(longer) >= len(ended) + 2
    assert not any(out.token_id in subject.model.eos_token_ids for out in longer[:len(ended) + 1])


@pytest.mark.model_feature("stops")
def test_a_stop_string_is_held_back_and_not_returned(subject: Subject) -> None:
    plain = subject.alone(STORY, replace(FORCED, max_tokens=24))
    full = text(plain)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    at = full.find(stop)
    stopped = subject.alone(STORY, replace(FORCED, max_tokens=24, stop=("\x00never", stop)))
    check_whole(stopped)
    assert stopped[-1].finish_reason == "stop"
    assert text(stopped) == full[:at]
    assert tokens(stopped) == tokens(plain)[:len(stopped)]


@pytest.mark.model_feature("stops")
def test_a_resumed_request_keeps_text_held_for_a_stop_string(subject: Subject) -> None:
    """Delivered tokens are replayed through the detokenizer and the stop matcher: the text continues exactly
    where the lost worker left it, held-back characters included."""
    plain = subject.alone(STORY, replace(FORCED, max_tokens=24))
    full = text(plain)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    params = replace(FORCED, max_tokens=24, stop=(stop,))
    whole = subject.alone(STORY, params)
    cut = len(whole) - 1
    rest = subject.alone(STORY, params, tokens(whole)[:cut])
    assert [(out.index, out.text, out.finish_reason) for out in rest] == [
        (out.index, out.text, out.finish_reason) for out in whole[cut:]]


@pytest.mark.model_feature("sampling")
def test_seeded_sampling_repeats_and_seeds_differ(subject: Subject) -> None:
    params = replace(FORCED, temperature=1.0, top_p=1.0, top_k=0, max_tokens=12)
    one = subject.alone(STORY, replace(params, seed=11))
    again = subject.alone(STORY, replace(params, seed=11))
    other = subject.alone(STORY, replace(params, seed=12))
    assert tokens(one) == tokens(again)
    assert tokens(one) != tokens(other)


@pytest.mark.model_feature("logprobs")
def test_logprobs_describe_the_choice(subject: Subject) -> None:
    plain = subject.alone(STORY, FORCED)
    described = subject.alone(STORY, replace(FORCED, logprobs=3))
    assert tokens(described) == tokens(plain)
    for out in described:
        assert out.logprob is not None and out.logprob.logprob <= 0
        assert len(out.top_logprobs) == 3
        values = [entry.logprob for entry in out.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert out.top_logprobs[0].token == out.logprob.token  # greedy: the chosen one is the most likely
        assert out.logprob.logprob == pytest.approx(values[0], abs=1e-4)
    only = subject.alone(STORY, replace(FORCED, logprobs=0, max_tokens=3))
    assert all(out.logprob is not None and out.top_logprobs == [] for out in only)


@pytest.mark.model_feature("sampling")
def test_logit_bias_bans_and_forces_tokens(subject: Subject) -> None:
    plain = subject.alone(STORY, replace(FORCED, max_tokens=4))
    banned = subject.alone(STORY, replace(FORCED, max_tokens=4, logit_bias=((plain[0].token_id, -100.0),)))
    assert banned[0].token_id != plain[0].token_id
    forced_token = subject.ids(" fish")[-1]
    forced = subject.alone(STORY, replace(FORCED, max_tokens=3, logit_bias=((forced_token, 100.0),)))
    assert tokens(forced) == [forced_token] * 3


@pytest.mark.model_feature("sampling")
def test_penalties_make_repeats_rarer(subject: Subject) -> None:
    plain = tokens(subject.alone(LOOP, replace(FORCED, max_tokens=24)))
    penalised = tokens(subject.alone(LOOP, replace(FORCED, max_tokens=24, frequency_penalty=1.5,
                                                   presence_penalty=0.5)))
    assert len(penalised) - len(set(penalised)) < len(plain) - len(set(plain))


@pytest.mark.model_feature("sampling")
@pytest.mark.parametrize(("frequency", "presence"), [(0.8, 0.4), (0.0, 0.7), (0.0, 1.2)])
def test_a_resumed_request_keeps_its_penalties(subject: Subject, frequency: float, presence: float) -> None:
    """The delivered tokens count for the frequency and presence penalties after a move as before it: once
    each for presence, also when one of them is generated again (which these prompts and penalties do)."""
    params = replace(FORCED, max_tokens=30, frequency_penalty=frequency, presence_penalty=presence)
    for prompt, cut in ((LOOP, 4), (LOOP, 10), (FOX, 4)):
        whole = subject.alone(prompt, params)
        rest = subject.alone(prompt, params, tokens(whole)[:cut])
        assert tokens(rest) == tokens(whole)[cut:], (prompt, cut)


@pytest.mark.model_feature("grammar")
def test_a_grammar_holds_the_answer_to_a_json_schema(subject: Subject) -> None:
    chat = subject.model.prompt_ids(Submit("c", GREEDY, messages=[ChatMessage("user", "Describe Paris in JSON.")]))
    params = replace(GREEDY, max_tokens=60, grammar=grammars.json_schema(SCHEMA))
    answer = subject.run({0: [("x", chat, params)]})["x"]
    check_whole(answer)
    assert answer[-1].finish_reason == "stop"
    value = json.loads(text(answer))
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)


@pytest.mark.model_feature("grammar")
def test_a_resumed_constrained_request_continues_inside_its_grammar(subject: Subject) -> None:
    chat = subject.model.prompt_ids(Submit("c", GREEDY, messages=[ChatMessage("user", "Describe Paris in JSON.")]))
    params = replace(GREEDY, max_tokens=60, grammar=grammars.json_schema(SCHEMA))
    whole = subject.run({0: [("x", chat, params)]})["x"]
    rest = subject.run({0: [("x", chat, params, tokens(whole)[:4])]})["x"]
    check_whole(rest, first=4)
    assert text(whole[:4]) + text(rest) == text(whole)
    json.loads(text(whole[:4]) + text(rest))


@pytest.mark.model_feature("grammar")
def test_a_grammar_that_cannot_be_read_is_refused_at_add(subject: Subject) -> None:
    with pytest.raises((GrammarError, ValueError)):
        subject.engine.add("bad", subject.ids(STORY), replace(GREEDY, grammar='{"grammars": "nonsense"}'))
    subject.run({})


@pytest.mark.model_feature("chat")
def test_the_model_tokenizes_chats_and_detokenizes(subject: Subject) -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Capital of France?")]
    ids = subject.model.prompt_ids(Submit("c", GREEDY, messages=messages))
    answer = subject.model.answer(Tokenize("t", messages=messages, with_strings=True))
    assert answer.tokens == ids and len(answer.strings) == len(ids)
    assert answer.context == subject.model.max_length
    rendered = subject.model.answer(Detokenize("d", ids)).text
    assert "Capital of France?" in rendered and "Be brief." in rendered
    assert subject.model.vocab >= max(ids)
