"""The own engine's planner as pure policy: who joins which prefill group, which group goes next, what kind of
step runs. No model: sequences carry only their ids and prompts."""

from __future__ import annotations

import pytest

from worker.output import SequenceText
from worker.own.planner import IDLE_PASS_TOKENS, Planner, Shape
from worker.own.sequences import Sequence

BLOCK = 16
BLOCKS = Shape(mixes=True, exact_blocks=True, blocks_together=True)


def sequence(request_id: str, prompt_tokens: int) -> Sequence:
    text = SequenceText(request_id, prompt_tokens, params=None, detokenizer=None, stops=None)
    return Sequence(text, list(range(prompt_tokens)), generator=None)


def planner(slots: int = 16, shape: Shape = BLOCKS) -> Planner:
    return Planner(slots, BLOCK, chunk_blocks=1, shape=shape, store=None)


def arrive(plan: Planner, *lengths: int, name: str = "r", start: int = 0) -> list[Sequence]:
    sequences = [sequence(f"{name}{i}", n) for i, n in enumerate(lengths, start=start)]
    plan.waiting.extend(sequences)
    return sequences


def groups(plan: Planner) -> list[list[str]]:
    return [[s.request_id for s in g.sequences] for g in plan.prefills]


def test_short_prompts_arriving_together_share_one_group():
    plan = planner()
    arrive(plan, *[12] * 16)
    assert plan.schedule(running=0).kind == "prefill"
    assert groups(plan) == [[f"r{i}" for i in range(16)]]


def test_prompts_admitted_together_advance_as_one_group_whatever_their_length():
    plan = planner()
    arrive(plan, 900, 12, 400)
    plan.schedule(running=0)
    assert groups(plan) == [["r0", "r1", "r2"]]
    (group,) = plan.prefills
    assert plan.next_group() is group and group.remaining(BLOCK) == -(-900 // BLOCK)


def test_turns_alternate_between_the_group_nearest_its_end_and_the_oldest():
    plan = planner()
    arrive(plan, 900)
    plan.schedule(running=0)
    plan.prefills[0].depth += BLOCK  # started: the next arrivals form a group of their own
    arrive(plan, 40, start=1)
    plan.schedule(running=0)
    old, short = plan.prefills
    assert [plan.next_group() for _ in range(4)] == [short, old, short, old]
    old.depth += IDLE_PASS_TOKENS  # nearer its end now, but still further than the short one
    assert plan.next_group() is short


def test_a_group_that_has_started_takes_no_newcomer():
    plan = planner()
    arrive(plan, 12)
    plan.schedule(running=0)
    plan.prefills[0].depth += BLOCK  # its first forward ran
    arrive(plan, 12, start=1)
    plan.schedule(running=0)
    assert len(plan.prefills) == 2


def test_without_exact_blocks_every_sequence_is_its_own_group():
    plan = planner(shape=Shape(mixes=False, exact_blocks=False, blocks_together=False))
    arrive(plan, 12, 12, 12)
    plan.schedule(running=0)
    assert groups(plan) == [["r0"], ["r1"], ["r2"]]


def test_slots_bound_what_is_admitted():
    plan = planner(slots=4)
    arrive(plan, *[12] * 6)
    plan.schedule(running=2)
    assert sum(len(g) for g in groups(plan)) == 2
    assert [s.request_id for s in plan.waiting] == ["r2", "r3", "r4", "r5"]


@pytest.mark.parametrize(("shape", "kinds"), [
    (BLOCKS, ["mixed", "mixed", "mixed"]),
    (Shape(mixes=False, exact_blocks=True, blocks_together=False), ["prefill", "decode", "prefill"]),
])
def test_running_streams_are_never_held_for_more_than_a_chunk(shape, kinds):
    plan = planner(shape=shape)
    arrive(plan, 900)
    assert [plan.schedule(running=3).kind for _ in kinds] == kinds


def test_cancel_removes_a_row_from_its_group_and_a_group_left_empty():
    plan = planner()
    arrive(plan, 12, 12)
    plan.schedule(running=0)
    plan.prefills[0].depth += BLOCK
    arrive(plan, 900, start=2)
    plan.schedule(running=0)
    assert groups(plan) == [["r0", "r1"], ["r2"]]
    assert plan.cancel("r1") and groups(plan) == [["r0"], ["r2"]]
    assert plan.cancel("r2") and groups(plan) == [["r0"]]
    assert not plan.cancel("r9")


def batch_lines(plan: Planner, *lengths: int) -> list[Sequence]:
    sequences = arrive(plan, *lengths, name="b")
    for s in sequences:
        s.background = True
    return sequences


def test_an_interactive_prompt_is_prefilled_ahead_of_the_batch_lanes_decode():
    plan = planner(slots=64)
    arrive(plan, 12)
    # With batch lines running, its chunk is a step of its own, then the decode (never two in a row).
    assert plan.schedule(running=40, background=True).kind == "prefill"
    assert plan.schedule(running=40, background=True).kind == "mixed"
    assert plan.schedule(running=40, background=True).kind == "prefill"
    # Among interactive streams only, it rides in their decode step as before.
    assert plan.schedule(running=8, background=False).kind == "mixed"


def test_batch_lines_prefill_inside_the_decode_step():
    plan = planner(slots=64)
    batch_lines(plan, 12)
    assert [plan.schedule(running=40, background=True).kind for _ in range(2)] == ["mixed", "mixed"]


def test_interactive_groups_go_before_older_batch_groups_and_never_share_one():
    plan = planner()
    batch_lines(plan, 12, 12)
    plan.schedule(running=0)
    arrive(plan, 12, 40)
    plan.schedule(running=0)
    assert groups(plan) == [["b0", "b1"], ["r0", "r1"]]
    assert [plan.next_group().sequences[0].request_id for _ in range(2)] == ["r0", "r0"]
