"""worker/output.py's plain functions, which serve without a tokenizer: the prompt check and the finish by length
that every engine shares (ENGINE=sim too), and the end on arrival of a migrated request wholly delivered."""

from __future__ import annotations

import pytest

from common.protocol import SamplingParams
from worker.core import PromptTooLong
from worker.output import check_prompt, delivered_reason, length_reason
from worker.sim import SimEngine, SimModel


def test_a_prompt_must_leave_room_for_a_token() -> None:
    check_prompt([1] * 7, [2], 9)
    with pytest.raises(PromptTooLong, match="empty"):
        check_prompt([], [], 9)
    with pytest.raises(PromptTooLong, match="context is 9 tokens"):
        check_prompt([1] * 7, [2, 2], 9)


def test_a_sequence_ends_at_max_tokens_or_at_its_context() -> None:
    params = SamplingParams(max_tokens=4)
    assert [length_reason(params, 2, emitted, 100) for emitted in (3, 4)] == [None, "length"]
    assert [length_reason(params, 6, emitted, 9) for emitted in (2, 3)] == [None, "length"]


def test_a_migrated_request_wholly_delivered_ends_on_arrival() -> None:
    params = SamplingParams(max_tokens=3)
    assert delivered_reason(params, [5, 6]) is None
    assert delivered_reason(params, [5, 6, 7]) == "length"


def test_the_sim_engine_checks_and_ends_as_the_others_do() -> None:
    model = SimModel(max_length=6)
    engine = SimEngine(model, slots=2, step_s=0, per_sequence_s=0)
    with pytest.raises(PromptTooLong):
        engine.add("empty", [], SamplingParams())
    engine.add("long", [0, 1, 2], SamplingParams(max_tokens=100))
    engine.add("short", [0], SamplingParams(max_tokens=2))
    reasons: dict[str, list[str | None]] = {}
    while engine.has_work():
        for output in engine.step().outputs:
            reasons.setdefault(output.request_id, []).append(output.finish_reason)
    assert reasons == {"long": [None, None, "length"], "short": [None, "length"]}
