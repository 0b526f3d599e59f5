"""The scheduler's policy, pure: who runs next, on which worker, in which message."""

from collections import Counter

from common.protocol import SamplingParams, Submit
from scheduler.policy import (
    BACKGROUND,
    BATCH_OVERHEAD,
    PRIORITY_CLASSES,
    YIELD_LIMIT,
    InteractivePeak,
    Queued,
    WaitingQueue,
    WorkerState,
    Yields,
    fits_a_batch,
    interactive_demand,
    lines_to_yield,
    plan,
    priority_class,
    tenant_cap,
)

LIMIT = 1 << 20


def item(rid: str, tenant: str = "t", at: float = 0.0, size: int = 100, migrations: int = 0,
         deadline: float = 0.0, priority: int = 0, background: bool = False, model: str = "",
         yields: int = 0) -> Queued:
    submit = Submit(rid, SamplingParams(), prompt="p", submitted_at=at, tenant=tenant, migrations=migrations,
                    deadline=deadline, priority=priority, background=background, model=model, yields=yields)
    return Queued(submit, rid.encode(), size)


def queue_of(*items: Queued) -> WaitingQueue:
    queue = WaitingQueue()
    for queued in items:
        queue.add(queued)
    return queue


def ids(batch: list[Queued]) -> list[str]:
    return [queued.request_id for queued in batch]


def test_a_burst_is_spread_over_workers_as_one_batch_each() -> None:
    queue = queue_of(*(item(f"r{i}", at=i) for i in range(6)))
    batches = plan(queue, [WorkerState("a", 16), WorkerState("b", 16)], LIMIT)
    assert sorted(len(batch) for _, batch in batches) == [3, 3]
    assert not queue


def test_no_worker_gets_more_than_its_free_slots_and_the_rest_waits_in_order() -> None:
    busy = WorkerState("a", 4, assigned={"x": "other", "y": "other", "z": "other"})
    queue = queue_of(*(item(f"r{i}", at=i) for i in range(5)))
    batches = dict(plan(queue, [busy, WorkerState("b", 2)], LIMIT))
    assert ids(batches["b"]) == ["r0", "r2"]
    assert ids(batches["a"]) == ["r1"]
    assert [q.request_id for q in queue] == ["r3", "r4"]


def test_nothing_is_planned_without_free_workers() -> None:
    queue = queue_of(item("r0"), item("r1", at=1))
    assert plan(queue, [WorkerState("a", 1, assigned={"x": "t"})], LIMIT) == []
    assert plan(queue, [], LIMIT) == []
    assert len(queue) == 2


def test_a_draining_worker_gets_nothing() -> None:
    queue = queue_of(*(item(f"r{i}", at=i) for i in range(3)))
    batches = plan(queue, [WorkerState("a", 16, draining=True), WorkerState("b", 16)], LIMIT)
    assert [worker for worker, _ in batches] == ["b"] and len(batches[0][1]) == 3


def test_migrated_requests_go_first() -> None:
    queue = queue_of(item("new", at=0), item("moved", at=5, migrations=1))
    [(_, batch)] = plan(queue, [WorkerState("a", 1)], LIMIT)
    assert ids(batch) == ["moved"]


def test_a_flooding_tenant_does_not_delay_a_newcomer() -> None:
    flood = [item(f"heavy{i}", tenant="heavy", at=i) for i in range(100)]
    queue = queue_of(*flood, item("light", tenant="light", at=1000))
    worker = WorkerState("a", 8, assigned={f"run{i}": "heavy" for i in range(7)})
    [(_, batch)] = plan(queue, [worker], LIMIT)
    assert ids(batch) == ["light"]  # one slot free: it goes to the tenant that runs nothing


def test_tenants_take_turns_by_what_they_run() -> None:
    queue = queue_of(*(item(f"a{i}", tenant="A", at=i) for i in range(4)),
                     *(item(f"b{i}", tenant="B", at=10 + i) for i in range(4)))
    [(_, batch)] = plan(queue, [WorkerState("w", 4)], LIMIT)
    assert sorted(ids(batch)) == ["a0", "a1", "b0", "b1"]


def test_one_tenant_never_holds_every_slot() -> None:
    queue = queue_of(*(item(f"r{i}", tenant="one", at=i) for i in range(40)))
    workers = [WorkerState("a", 16), WorkerState("b", 16)]
    batches = plan(queue, workers, LIMIT)
    assert sum(len(batch) for _, batch in batches) == tenant_cap(32) == 28
    assert len(queue) == 12
    newcomer = queue_of(item("other", tenant="two"))
    for worker_id, batch in batches:
        next(w for w in workers if w.worker_id == worker_id).assigned.update({q.request_id: "one" for q in batch})
    assert [ids(batch) for _, batch in plan(newcomer, workers, LIMIT)] == [["other"]]


def test_a_tenant_alone_on_a_single_slot_still_runs() -> None:
    assert tenant_cap(1) == 1 and tenant_cap(2) == 1 and tenant_cap(16) == 14


def test_batches_are_cut_to_fit_one_message() -> None:
    big = LIMIT // 3
    queue = queue_of(*(item(f"r{i}", at=i, size=big) for i in range(7)))
    batches = plan(queue, [WorkerState("a", 16)], LIMIT)
    assert [len(batch) for _, batch in batches] == [2, 2, 2, 1]
    assert all(BATCH_OVERHEAD + sum(q.size for q in batch) <= LIMIT for _, batch in batches)
    assert [r for _, b in batches for r in ids(b)] == \
        [f"r{i}" for i in range(7)]


def test_a_request_fits_a_batch_only_with_room_for_the_envelope() -> None:
    assert fits_a_batch(LIMIT - BATCH_OVERHEAD, LIMIT)
    assert not fits_a_batch(LIMIT - BATCH_OVERHEAD + 1, LIMIT)


def test_expired_and_removed_requests_leave_the_queue() -> None:
    queue = queue_of(item("old", deadline=5.0), item("fresh", deadline=50.0, at=1), item("keep", at=2),
                     item("moved", migrations=1, deadline=1.0))
    assert sorted(q.request_id for q in queue.expired(10.0)) == ["moved", "old"]
    assert queue.remove("keep").request_id == "keep"
    assert queue.remove("nothing") is None
    assert [q.request_id for q in queue] == ["fresh"]
    assert queue.pop_next(Counter(), cap=1).request_id == "fresh" and not queue


def test_fifo_serves_in_arrival_order_with_no_cap() -> None:
    queue = WaitingQueue(fair=False)
    for queued in [*(item(f"heavy{i}", tenant="heavy", at=i) for i in range(20)), item("light", "light", at=99)]:
        queue.add(queued)
    [(_, batch)] = plan(queue, [WorkerState("a", 16)], LIMIT)
    assert ids(batch) == [f"heavy{i}" for i in range(16)]


def popped(queue: WaitingQueue, running: Counter[str] | None = None, cap: int = 100) -> list[str]:
    order = []
    while (next_item := queue.pop_next(running or Counter(), cap)) is not None:
        order.append(next_item.request_id)
    return order


def test_within_a_tenant_the_lowest_priority_goes_first_then_the_oldest() -> None:
    queue = queue_of(item("late", at=1, priority=5), item("old", at=2), item("urgent", at=3, priority=-1),
                     item("new", at=4), item("same-time", at=4))
    assert popped(queue) == ["urgent", "old", "new", "same-time", "late"]


def test_priority_never_overtakes_another_tenant_s_fair_share() -> None:
    queue = queue_of(item("a-urgent", tenant="a", at=1, priority=-100), item("b-lazy", tenant="b", at=2, priority=9))
    assert popped(queue, Counter({"a": 3})) == ["b-lazy", "a-urgent"]  # b runs fewer: its turn first


def test_between_tenants_that_run_as_many_the_lower_priority_goes_first() -> None:
    """Without API keys every request is a tenant of its own, running none: priority orders them all."""
    queue = queue_of(item("first", tenant="r1", at=1, priority=3), item("second", tenant="r2", at=2),
                     item("third", tenant="r3", at=3, priority=-2))
    assert popped(queue) == ["third", "second", "first"]


def test_migrated_requests_still_go_before_any_priority() -> None:
    queue = queue_of(item("urgent", priority=-9), item("moved", at=5, migrations=1, priority=9))
    assert popped(queue) == ["moved", "urgent"]


def test_under_fifo_priority_orders_every_tenant_s_requests() -> None:
    queue = WaitingQueue(fair=False)
    for queued in (item("a", tenant="x", at=1), item("b", tenant="y", at=2, priority=-1), item("c", tenant="z", at=3)):
        queue.add(queued)
    assert popped(queue) == ["b", "a", "c"]


def test_removing_and_expiring_keep_the_priority_order() -> None:
    queue = queue_of(*(item(f"r{i}", at=i, priority=-i % 3, deadline=100 if i == 4 else 0) for i in range(8)))
    assert queue.remove("r2") is not None
    assert [gone.request_id for gone in queue.expired(200)] == ["r4"]
    assert popped(queue) == ["r0", "r3", "r6", "r5", "r1", "r7"]


# The background lane (batch jobs' lines).


def test_a_background_line_waits_while_an_interactive_request_waits() -> None:
    queue = queue_of(item("line", at=0, background=True), item("chat", at=5))
    [(_, batch)] = plan(queue, [WorkerState("a", 1)], LIMIT)
    assert ids(batch) == ["chat"] and [q.request_id for q in queue] == ["line"]
    [(_, batch)] = plan(queue, [WorkerState("a", 1)], LIMIT)
    assert ids(batch) == ["line"] and not queue


def test_background_lines_leave_an_interactive_share_of_the_slots_free() -> None:
    queue = queue_of(*(item(f"l{i}", at=i, background=True) for i in range(40)))
    batches = plan(queue, [WorkerState("a", 16), WorkerState("b", 16)], LIMIT)
    assert sum(len(batch) for _, batch in batches) == tenant_cap(32) == 28
    running = {"x": BACKGROUND, "y": BACKGROUND, "z": "someone"}
    assert sum(len(b) for _, b in plan(queue, [WorkerState("a", 16, assigned=running)], LIMIT)) == 12
    assert plan(queue, [WorkerState("a", 2, assigned={"x": BACKGROUND})], LIMIT) == []


def test_the_peak_of_interactive_demand_is_kept_for_its_window() -> None:
    peak = InteractivePeak(window=5.0)
    assert [peak.note(t, d) for t, d in [(0, 3), (1, 8), (2, 7), (3, 2), (5.5, 4)]] == [3, 8, 8, 8, 8]
    assert peak.note(6.5, 1) == 7  # 8 (at 1) left the window; 7 (at 2) is the highest left
    assert peak.note(7.5, 0) == 4 and peak.note(20, 0) == 0


def test_interactive_demand_counts_running_and_waiting_requests_but_not_lines() -> None:
    queue = queue_of(item("chat", at=1), item("line", background=True), item("moved", migrations=1))
    worker = WorkerState("a", 16, assigned={"x": "t", "y": BACKGROUND, "z": "u"})
    assert interactive_demand(queue, [worker]) == 4


def test_lines_leave_free_the_slots_interactive_streams_held_a_moment_ago() -> None:
    # 8 closed-loop streams on 16 slots: one has just ended and its client's next request is on its way.
    streams = {f"s{i}": "t" for i in range(7)}
    lines = {f"x{i}": BACKGROUND for i in range(8)}
    worker = WorkerState("a", 16, assigned={**streams, **lines})
    queue = queue_of(*(item(f"l{i}", at=i, background=True) for i in range(10)))
    peak = InteractivePeak()
    peak.note(0.0, 8)
    assert plan(queue, [worker], LIMIT, 0.5, peak.note(0.5, interactive_demand(queue, [worker]))) == []
    queue.add(item("next", at=0.6))
    [(_, batch)] = plan(queue, [worker], LIMIT, 0.6, peak.note(0.6, interactive_demand(queue, [worker])))
    assert ids(batch) == ["next"]
    # Without the reservation (the previous rule) a line took that slot.
    assert ids(plan(queue_of(item("l", background=True)), [worker], LIMIT)[0][1]) == ["l"]


def test_the_lane_counts_as_one_tenant_whoever_owns_the_lines() -> None:
    queue = queue_of(item("l0", tenant="k1", background=True), item("l1", tenant="k2", at=1, background=True))
    assert [q.tenant for q in queue] == [BACKGROUND, BACKGROUND]
    [(_, batch)] = plan(queue, [WorkerState("a", 16)], LIMIT)
    assert ids(batch) == ["l0", "l1"]


def test_an_interactive_request_of_another_model_does_not_hold_up_the_lane() -> None:
    queue = queue_of(item("chat", model="big"), item("line", background=True, model="small"))
    small = WorkerState("s", 4, models=frozenset({"small"}))
    [(worker, batch)] = plan(queue, [small], LIMIT)
    assert (worker, ids(batch)) == ("s", ["line"]) and [q.request_id for q in queue] == ["chat"]


def test_the_lane_runs_by_priority_then_age_and_its_lines_expire_and_cancel() -> None:
    queue = queue_of(item("old", at=0, background=True), item("urgent", at=3, background=True, priority=-1),
                     item("late", at=1, background=True, deadline=10.0))
    assert ids(queue.expired(20.0)) == ["late"]
    assert queue.remove("old").request_id == "old"
    [(_, batch)] = plan(queue, [WorkerState("a", 4)], LIMIT)
    assert ids(batch) == ["urgent"] and not queue


def test_the_metrics_label_a_request_by_its_class_of_urgency() -> None:
    classes = [priority_class(item(f"r{p}", priority=p).submit) for p in (-3, 0, 7)]
    assert classes == ["urgent", "default", "low"]
    assert priority_class(item("line", priority=-3, background=True).submit) == "background"
    assert set(PRIORITY_CLASSES) == {*classes, "background"}


def lane(worker_id: str, slots: int, lines: int, interactive: int = 0, models: frozenset[str] = frozenset(),
         draining: bool = False) -> WorkerState:
    """A worker running `interactive` requests of tenant "i", then `lines` batch lines l0.. (dispatched in order)."""
    assigned = {**{f"{worker_id}-i{n}": "i" for n in range(interactive)},
                **{f"{worker_id}-l{n}": BACKGROUND for n in range(lines)}}
    return WorkerState(worker_id, slots, assigned, draining=draining, models=models)


def test_no_line_yields_while_free_slots_take_the_interactive_requests_waiting() -> None:
    queue = queue_of(item("r0", tenant="a"), item("r1", tenant="b"), item("bg", background=True))
    assert lines_to_yield(queue, [lane("w", 8, lines=6)]) == {}
    assert lines_to_yield(queue_of(item("bg", background=True)), [lane("w", 8, lines=8)]) == {}


def test_a_surge_past_the_free_slots_takes_the_latest_lines_from_the_busiest_lanes() -> None:
    queue = queue_of(*(item(f"r{n}", tenant=f"t{n}", at=n) for n in range(5)))
    got = lines_to_yield(queue, [lane("a", 8, lines=5, interactive=2), lane("b", 8, lines=3, interactive=5)])
    # One slot free (a's), so 4 lines: from a while it has more lines left than b (5, then 4, then even at 3: the
    # first listed), then from b.
    assert got == {"a": ["a-l4", "a-l3", "a-l2"], "b": ["b-l2"]}


def test_lines_already_yielding_count_as_slots_coming_free_and_are_not_asked_again() -> None:
    queue = queue_of(*(item(f"r{n}", tenant=f"t{n}", at=n) for n in range(3)))
    workers = [lane("a", 4, lines=4)]
    assert lines_to_yield(queue, workers) == {"a": ["a-l3", "a-l2", "a-l1"]}
    assert lines_to_yield(queue, workers, {"a-l3", "a-l2"}) == {"a": ["a-l1"]}
    assert lines_to_yield(queue, workers, {"a-l3", "a-l2", "a-l1"}) == {}


def test_a_tenant_at_its_cap_makes_no_line_yield() -> None:
    """16 slots: a tenant holds at most 14; one holding 13 may start one more, whatever it has waiting."""
    queue = queue_of(*(item(f"r{n}", tenant="i", at=n) for n in range(5)))
    assert lines_to_yield(queue, [lane("a", 16, lines=3, interactive=13)]) == {"a": ["a-l2"]}
    assert lines_to_yield(queue, [lane("a", 16, lines=2, interactive=14)]) == {}


def test_only_the_lines_of_workers_serving_the_waiting_model_yield_and_not_while_draining() -> None:
    queue = queue_of(item("r0", tenant="x", model="m1"), item("r1", tenant="y", model="m1"))
    m1, m2 = frozenset({"m1"}), frozenset({"m2"})
    workers = [lane("one", 2, lines=2, models=m1), lane("two", 2, lines=2, models=m2)]
    assert lines_to_yield(queue, workers) == {"one": ["one-l1", "one-l0"]}
    workers[0].draining = True  # its lines go with its hand-off; its slots are no help
    assert lines_to_yield(queue, workers) == {}


def test_migrated_interactive_requests_count_and_a_free_slot_counts_once() -> None:
    queue = queue_of(item("moved", tenant="x", migrations=1, model="m"), item("r0", tenant="y", model="n"))
    both = frozenset({"m", "n"})
    assert lines_to_yield(queue, [lane("w", 4, lines=3, models=both)]) == {"w": ["w-l2"]}


def test_a_moved_line_goes_back_to_the_lane_ahead_of_newer_lines_but_behind_interactive_requests() -> None:
    """A line moved off a lost worker (migrations) or handed back (yields) waits in the background lane, where its
    age puts it first; it does not jump the interactive queue as a moved stream does."""
    queue = queue_of(item("new-line", at=9, background=True), item("chat", at=8),
                     item("lost-line", at=1, background=True, migrations=1),
                     item("yielded-line", at=2, background=True, yields=1, migrations=0))
    assert queue.interactive() == 1 and not queue.migrated
    order = [ids(batch) for _ in range(4) for _, batch in plan(queue, [WorkerState("a", 1)], LIMIT)]
    assert order == [["chat"], ["lost-line"], ["yielded-line"], ["new-line"]]


def test_a_line_at_its_yield_limit_runs_to_its_end() -> None:
    queue = queue_of(*(item(f"r{n}", tenant=f"t{n}", at=n) for n in range(2)))
    worker = lane("a", 4, lines=4)
    worker.settled = {"a-l3"}
    assert lines_to_yield(queue, [worker]) == {"a": ["a-l2", "a-l1"]}
    worker.settled = {f"a-l{n}" for n in range(4)}
    assert lines_to_yield(queue, [worker]) == {}
    assert YIELD_LIMIT == 3


def test_lines_asked_to_yield_are_asked_again_only_after_the_patience_passes() -> None:
    yields = Yields(patience=0.6)
    workers = [lane("a", 4, lines=4)]
    queue = queue_of(item("r0", tenant="x"), item("r1", tenant="y", at=1))
    assert yields.ask(queue, workers, 10.0) == {"a": ["a-l3", "a-l2"]}
    assert yields.ask(queue, workers, 10.3) == {}  # both still coming free
    del workers[0].assigned["a-l3"]  # its Yielded came: off the worker, it frees the slot it was asked for
    workers[0].assigned["r0"] = "x"
    queue.remove("r0")
    assert yields.ask(queue, workers, 10.4) == {} and set(yields.asked) == {"a-l2"}
    assert yields.ask(queue, workers, 10.7) == {"a": ["a-l2"]}  # no answer within the patience: asked again
    assert yields.ask(queue_of(), workers, 20.0) == {} and yields.asked == {}
