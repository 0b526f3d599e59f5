"""Stop strings, presence and frequency penalties and log-probabilities, on the real default model in-process."""

from __future__ import annotations

import pytest
import torch
from msgspec.structs import replace

from common.protocol import SamplingParams
from tests.conftest import run_engine
from worker.core import StepOutput
from worker.own.engine import Engine
from worker.own.model import LoadedModel
from worker.sampling import MAX_TOP_LOGPROBS, sample
from worker.stops import StopMatcher

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = {
    "a": "The quick brown",
    "b": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "c": "Paris is",
    "loop": "one two one two one two one two one two",
}
NEVER = "\x00"  # a character the model never writes: a stop string ending in it never completes


def prompt_ids(loaded: LoadedModel, key: str) -> list[int]:
    return loaded.tokenizer(PROMPTS[key])["input_ids"]


def alone(loaded: LoadedModel, ids: list[int], params: SamplingParams) -> list[StepOutput]:
    return run_engine(Engine(loaded, 16), {0: [("x", ids, params)]})["x"]


def solo(loaded: LoadedModel, key: str, params: SamplingParams = GREEDY) -> list[StepOutput]:
    return alone(loaded, prompt_ids(loaded, key), params)


def tokens(outputs: list[StepOutput]) -> list[int]:
    return [out.token_id for out in outputs]


def texts(outputs: list[StepOutput]) -> list[str]:
    return [out.text for out in outputs]


def reasons(outputs: list[StepOutput]) -> list[str | None]:
    return [out.finish_reason for out in outputs]


def repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_the_stop_matcher_holds_back_only_what_may_start_a_stop_string() -> None:
    matcher = StopMatcher(("", "END", "ab"))
    assert matcher.push("xxE", last=False) == ("xx", False)
    assert matcher.push("Nd", last=False) == ("ENd", False)
    assert matcher.push("a", last=False) == ("", False)
    assert matcher.push("a", last=False) == ("a", False)
    assert matcher.push("bEND", last=False) == ("", True)
    matcher = StopMatcher(("END",))
    assert matcher.push("xEN", last=True) == ("xEN", False)


def check_stop(loaded: LoadedModel, stop: str) -> list[StepOutput]:
    """Run "b" with `stop` and check it against the run without: the same tokens and text up to the stop
    string's first occurrence, and the step that completes it ends the sequence with finish_reason "stop"."""
    plain = solo(loaded, "b")
    full = "".join(texts(plain))
    at = full.find(stop)
    assert at > 0
    ends = next(n for n in range(len(plain) + 1) if len("".join(texts(plain[:n]))) >= at + len(stop))
    stopped = solo(loaded, "b", replace(GREEDY, stop=("zq" + NEVER, stop)))
    assert len(stopped) == ends < len(plain)
    assert reasons(stopped) == [None] * (ends - 1) + ["stop"]
    assert tokens(stopped) == tokens(plain)[:ends]
    assert "".join(texts(stopped)) == full[:at]
    assert not any(stop in text for text in texts(stopped))
    return stopped


def test_a_stop_string_from_the_middle_of_the_text_cuts_it_right_before(loaded: LoadedModel) -> None:
    words = "".join(texts(solo(loaded, "b"))).split()
    check_stop(loaded, " " + words[len(words) // 2])


def test_a_stop_string_split_across_two_tokens_is_caught(loaded: LoadedModel) -> None:
    pieces = texts(solo(loaded, "b"))
    full = "".join(pieces)
    for i in range(1, len(pieces) - 1):
        stop = pieces[i][-1:] + pieces[i + 1][:2]
        if len(stop) == 3 and full.find(stop) == len("".join(pieces[:i + 1])) - 1:
            break
    else:
        pytest.fail("no stop string spans two tokens in this text")
    stopped = check_stop(loaded, stop)
    assert len(stopped) == i + 2
    # The last character of token i waited: the next token showed it began the stop string.
    assert stopped[i].text == pieces[i][:-1]


def check_flush(loaded: LoadedModel, ids: list[int], params: SamplingParams, reason: str) -> None:
    """A stop string that begins with the text's last two characters before the last token but never
    completes: those characters wait, then go out with the last token, whatever ends the sequence."""
    plain = alone(loaded, ids, params)
    assert reasons(plain)[-1] == reason
    before_last = "".join(texts(plain[:-1]))
    held = before_last[-2:]
    assert len(held) == 2
    flushed = alone(loaded, ids, replace(params, stop=(held + NEVER,)))
    assert reasons(flushed) == reasons(plain)
    assert tokens(flushed) == tokens(plain)
    assert "".join(texts(flushed[:-1])) == before_last[:-2]
    assert flushed[-1].text == held + plain[-1].text


def test_held_back_text_goes_out_with_the_last_token_at_a_length_finish(loaded: LoadedModel) -> None:
    check_flush(loaded, prompt_ids(loaded, "b"), GREEDY, "length")


def test_held_back_text_goes_out_with_the_end_of_sequence_token(loaded: LoadedModel) -> None:
    chat = loaded.chat_ids([{"role": "user", "content": "Say hi."}])
    check_flush(loaded, chat, SamplingParams(max_tokens=200, temperature=0), "stop")


def test_penalties_lower_the_logits_of_generated_tokens_by_count_and_presence() -> None:
    logits = torch.zeros(4, 8)
    logits[:, :2] = torch.tensor([4.0, 3.9])
    generated = [[0, 0, 5]] * 4
    params = [SamplingParams(temperature=0, frequency_penalty=0.04),  # 4 - 2 * 0.04 = 3.92 still leads
              SamplingParams(temperature=0, frequency_penalty=0.06),  # 4 - 2 * 0.06 = 3.88 falls behind
              SamplingParams(temperature=0, frequency_penalty=0.04, presence_penalty=0.03),  # 3.89, once
              SamplingParams(temperature=0)]
    chosen, _ = sample(logits, params, [None] * 4, [[]] * 4, generated)
    assert chosen == [0, 1, 1, 0]


def test_zero_penalties_leave_the_greedy_output_alone(loaded: LoadedModel) -> None:
    zero = replace(GREEDY, presence_penalty=0.0, frequency_penalty=0.0)
    assert tokens(solo(loaded, "loop", zero)) == tokens(solo(loaded, "loop"))


def test_penalties_make_repeats_rarer(loaded: LoadedModel) -> None:
    plain = tokens(solo(loaded, "loop"))
    assert repeats(plain) > 0
    assert repeats(tokens(solo(loaded, "loop", replace(GREEDY, frequency_penalty=2.0)))) < repeats(plain)
    assert repeats(tokens(solo(loaded, "loop", replace(GREEDY, presence_penalty=100.0)))) == 0
    # A negative penalty rewards repeating.
    rewarded = tokens(solo(loaded, "b", replace(GREEDY, frequency_penalty=-5.0)))
    assert repeats(rewarded) > repeats(tokens(solo(loaded, "b")))


def test_logprobs_describe_the_greedy_choice_and_do_not_change_it(loaded: LoadedModel) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)  # nothing banned: the choice is the raw argmax
    plain = solo(loaded, "b", params)
    assert all(out.logprob is None and out.top_logprobs is None for out in plain)
    scored = solo(loaded, "b", replace(params, logprobs=5))
    assert tokens(scored) == tokens(plain)
    assert texts(scored) == texts(plain)
    for out, token in zip(scored, tokens(scored), strict=True):
        values = [top.logprob for top in out.top_logprobs]
        assert len(values) == 5
        assert values == sorted(values, reverse=True)
        assert all(value <= 0 for value in values)
        assert sum(torch.tensor(values).exp()) <= 1 + 1e-5
        assert out.logprob.logprob == values[0]
        assert out.logprob.token == loaded.tokenizer.decode([token])
        assert out.logprob.token in [top.token for top in out.top_logprobs]


def test_logprobs_of_a_sampled_row_and_the_bounds_of_the_count(loaded: LoadedModel) -> None:
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=7, ignore_eos=True)
    plain = solo(loaded, "a", seeded)
    scored = solo(loaded, "a", replace(seeded, logprobs=MAX_TOP_LOGPROBS + 30))
    assert tokens(scored) == tokens(plain)
    for out in scored:
        assert len(out.top_logprobs) == MAX_TOP_LOGPROBS
        assert out.logprob.logprob <= out.top_logprobs[0].logprob
        for top in out.top_logprobs:
            if top.token == out.logprob.token:
                assert top.logprob == out.logprob.logprob
    bare = solo(loaded, "a", replace(seeded, logprobs=0))
    assert all(out.top_logprobs == [] and out.logprob.logprob <= 0 for out in bare)


def logprob_values(outputs: list[StepOutput]) -> list[float]:
    """Every log-probability of a completion, chosen and alternatives, flattened in order."""
    return [value for out in outputs if out.logprob is not None
            for value in (out.logprob.logprob, *(top.logprob for top in out.top_logprobs))]


def test_the_features_mixed_in_a_batch_do_not_change_any_request(loaded: LoadedModel) -> None:
    words = "".join(texts(solo(loaded, "b"))).split()
    requests = {
        "stopped": ("b", replace(GREEDY, stop=(" " + words[len(words) // 3],))),
        "penalised": ("loop", replace(GREEDY, frequency_penalty=1.5, presence_penalty=0.5)),
        "scored": ("c", SamplingParams(max_tokens=16, temperature=0.8, seed=3, logprobs=4, presence_penalty=1.0,
                                       stop=("qz" + NEVER,))),
        "plain": ("a", GREEDY),
        "held": ("b", replace(GREEDY, max_tokens=10, stop=(words[3][:2] + NEVER,))),
    }
    arrivals = {0: ["stopped", "penalised"], 2: ["scored", "plain"], 5: ["held"]}
    mixed = run_engine(Engine(loaded, 16), {step: [(name, prompt_ids(loaded, requests[name][0]), requests[name][1])
                                            for name in names] for step, names in arrivals.items()})
    for name, (key, params) in requests.items():
        single = solo(loaded, key, params)
        assert tokens(mixed[name]) == tokens(single), name
        assert texts(mixed[name]) == texts(single), name
        assert reasons(mixed[name]) == reasons(single), name
        # The same tokens with the same log-probabilities, up to float rounding: a batch of another
        # shape takes other matrix kernels, which round differently in the last bits.
        assert logprob_values(mixed[name]) == pytest.approx(logprob_values(single), abs=1e-4), name
    assert reasons(mixed["stopped"])[-1] == "stop"


def test_a_vanishing_temperature_samples_greedily_instead_of_failing() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    params = [SamplingParams(temperature=1e-300, top_p=1e-300), SamplingParams(temperature=5e-6)]
    chosen, _ = sample(logits, params, [torch.Generator().manual_seed(1)] * 2, [[], []], [[], []])
    assert chosen == [1, 0]


def test_stop_strings_wait_for_min_tokens(loaded: LoadedModel) -> None:
    plain = solo(loaded, "b")
    word = " " + "".join(texts(plain)).split()[3]
    forced = solo(loaded, "b", replace(GREEDY, stop=(word,), min_tokens=GREEDY.max_tokens))
    assert tokens(forced) == tokens(plain) and texts(forced) == texts(plain)
    assert reasons(forced)[-1] == "length"
    assert reasons(solo(loaded, "b", replace(GREEDY, stop=(word,))))[-1] == "stop"
