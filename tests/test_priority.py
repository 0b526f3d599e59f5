"""`priority` through the whole stack (real redis-server, gateway, scheduler and an ENGINE=sim worker as processes,
real HTTP and SSE): with the one slot busy, waiting requests start by priority, lowest first, whatever order they
came in; the policy itself is tested in tests/test_policy.py."""

from __future__ import annotations

import threading
import time

from tests.conftest import sim_stack, wait_for
from tests.sse import Streamed, read


def test_waiting_requests_start_lowest_priority_first() -> None:
    with sim_stack(1, WORKER_SLOTS="1", SIM_STEP_MS="20", SIM_STEP_PER_SEQ_MS="0") as sim:
        busy = Streamed()
        readers = [threading.Thread(target=read, args=(sim.url, "/generate_stream"), kwargs={
            "body": {"prompt": "hold the slot", "max_tokens": 60, "ignore_eos": True}, "into": busy})]
        readers[0].start()
        wait_for(lambda: len(busy.events) >= 1, 30, "the busy request's first token")
        got: dict[int, Streamed] = {}
        for priority in (5, 0, -1, 2):  # all wait: the slot is busy for about a second more
            got[priority] = Streamed()
            body = {"prompt": f"priority {priority}", "max_tokens": 2, "ignore_eos": True, "priority": priority}
            readers.append(threading.Thread(target=read, args=(sim.url, "/generate_stream"),
                                            kwargs={"body": body, "into": got[priority]}))
            readers[-1].start()
            time.sleep(0.05)
        for reader in readers:
            reader.join(60)
        assert busy.ended == "done" and all(s.ended == "done" for s in got.values())
        started = sorted(got, key=lambda priority: got[priority].arrived[0])
        assert started == [-1, 0, 2, 5]
        assert got[-1].arrived[0] > busy.arrived[-1] - 0.2  # it waited for the slot


def test_a_priority_out_of_range_is_a_400() -> None:
    import httpx

    with sim_stack(1) as sim:
        answer = httpx.post(f"{sim.url}/v1/completions", timeout=30,
                            json={"model": "sim", "prompt": "p", "max_tokens": 2, "priority": 2**31})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "priority"


def test_a_keys_priority_floor_holds_it_back_and_the_scheduler_counts_each_class() -> None:
    """`llmserve quota beta --priority-floor 3`: beta's request asking for -5 runs at 3, after alpha's at 1; the
    scheduler's queue-wait histogram has a series per priority class."""
    import httpx

    from common.settings import Settings
    from llmserve.quota import quota

    keys = {"API_KEYS": "alpha,beta", "NAMESPACE": "floor"}
    with sim_stack(1, WORKER_SLOTS="1", SIM_STEP_MS="20", SIM_STEP_PER_SEQ_MS="0", **keys) as sim:
        settings = Settings(redis_url=sim.redis_url, namespace="floor", api_keys="alpha,beta")
        assert "priority at best 3" in quota("beta", None, None, False, settings, priority_floor=3)
        time.sleep(1.1)  # past the gateway's cache of floors
        busy = Streamed()
        readers = [threading.Thread(target=read, args=(sim.url, "/generate_stream"), kwargs={
            "body": {"prompt": "hold the slot", "max_tokens": 60, "ignore_eos": True}, "into": busy,
            "headers": {"Authorization": "Bearer alpha"}})]
        readers[0].start()
        wait_for(lambda: len(busy.events) >= 1, 30, "the busy request's first token")
        got = {"beta": Streamed(), "alpha": Streamed()}
        for key, priority in (("beta", -5), ("alpha", 1)):
            body = {"prompt": f"{key} asks {priority}", "max_tokens": 2, "ignore_eos": True, "priority": priority}
            readers.append(threading.Thread(target=read, args=(sim.url, "/generate_stream"), kwargs={
                "body": body, "into": got[key], "headers": {"Authorization": f"Bearer {key}"}}))
            readers[-1].start()
            time.sleep(0.05)
        for reader in readers:
            reader.join(60)
        assert got["alpha"].arrived[0] < got["beta"].arrived[0]
        assert "priority at best as asked" in quota("beta", None, None, True, settings)
        metrics = httpx.get(f"http://127.0.0.1:{sim.stack.env['SCHEDULER_METRICS_PORT']}/metrics").text
        for name in ("default", "low"):
            assert f'llmserve_scheduler_queue_wait_seconds_count{{priority="{name}"}}' in metrics
        assert 'llmserve_scheduler_waiting_by_priority{priority="urgent"} 0.0' in metrics
