from collections import deque

from common.protocol import SamplingParams, Submit
from scheduler.batcher import WorkerState, plan


def submits(n: int) -> deque[Submit]:
    return deque(Submit(f"r{i}", SamplingParams(), prompt="p") for i in range(n))


def test_a_burst_is_spread_over_workers_as_one_batch_each() -> None:
    waiting = submits(6)
    batches = plan(waiting, [WorkerState("a", 16), WorkerState("b", 16)])
    assert sorted(len(b) for b in batches.values()) == [3, 3]
    assert not waiting


def test_no_worker_gets_more_than_its_free_slots_and_the_rest_waits_in_order() -> None:
    busy = WorkerState("a", 4, assigned={"x", "y", "z"})
    waiting = submits(5)
    batches = plan(waiting, [busy, WorkerState("b", 2)])
    assert [s.request_id for s in batches["b"]] == ["r0", "r2"]
    assert [s.request_id for s in batches["a"]] == ["r1"]
    assert [s.request_id for s in waiting] == ["r3", "r4"]


def test_nothing_is_planned_without_free_workers() -> None:
    waiting = submits(2)
    assert plan(waiting, [WorkerState("a", 1, assigned={"x"})]) == {}
    assert plan(waiting, []) == {}
    assert len(waiting) == 2


def test_a_draining_worker_gets_nothing() -> None:
    waiting = submits(3)
    batches = plan(waiting, [WorkerState("a", 16, draining=True), WorkerState("b", 16)])
    assert list(batches) == ["b"] and len(batches["b"]) == 3
