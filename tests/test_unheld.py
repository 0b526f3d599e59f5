"""Assignments a worker does not hold: a Redis failover can keep the scheduler's assignment and drop the Batch that
went with it, or keep it and drop the worker's Finished. The worker reports them (worker/ownership.py's Audit) and
the scheduler moves them on or releases them (scheduler/roster.py's reclaim); here the rule, then a Batch lost on a
running sim stack, whose client still gets its whole stream."""

from __future__ import annotations

import os
import signal

from common.clients import sync_client
from common.keys import Keys
from common.protocol import SamplingParams, Submit, encode
from harness.stacks import live_workers
from tests.conftest import dispatched_to, pid_of, sim_stack, wait_for
from tests.sse import read, read_in_background
from worker.ownership import Audit


def test_an_assignment_is_reported_once_it_stays_unheld_past_a_check_and_again_while_it_stays() -> None:
    audit = Audit(every_s=2.0)
    assert audit.due(0.0)
    # "arriving": its Batch is on its way at the first check and held at the second.
    assert audit.check(["stale", "arriving", "running"], {"running"}, clock=0.0) == []
    assert not audit.due(1.9) and audit.due(2.0)
    assert audit.check(["stale", "arriving", "running"], {"running", "arriving"}, clock=2.0) == ["stale"]
    assert audit.check(["stale"], set(), clock=3.0) == []  # reported at 2.0: again only past every_s
    assert audit.check(["stale"], set(), clock=4.0) == ["stale"]  # its report may have been dropped too
    # One that went (the scheduler moved it) is forgotten: seen unheld again later, it waits a whole check.
    assert audit.check([], set(), clock=6.0) == []
    assert audit.check(["stale"], set(), clock=8.0) == []
    assert audit.check(["stale"], set(), clock=10.0) == ["stale"]


def test_a_batch_lost_on_its_way_to_the_worker_is_moved_on_and_its_client_gets_every_token() -> None:
    body = {"prompt": "unheld", "max_tokens": 60, "ignore_eos": True}
    with sim_stack(1, NAMESPACE="unheld", LOG_LEVEL="INFO") as stack:
        client, keys = sync_client(stack.redis_url), Keys("unheld")
        wait_for(lambda: live_workers(client, keys), 30, "the worker")
        [worker] = live_workers(client, keys)
        expected = read(stack.url, "/generate_stream", body=body).text
        # A long stream keeps the worker stepping, so that it reads its inbox without blocking: a blocked read
        # would get the Batch at once, whatever is deleted after.
        long = read_in_background(stack.url, [{"prompt": "busy", "max_tokens": 400, "ignore_eos": True}])
        wait_for(lambda: len(long.streams[0].tokens) > 5, 30, "the long stream under way")
        os.kill(pid_of(worker), signal.SIGSTOP)
        try:
            reading = read_in_background(stack.url, [body])
            wait_for(lambda: client.hlen(keys.assigned(worker)) == 2, 5, "the request dispatched")
            client.delete(keys.inbox(worker))  # its Batch, lost
        finally:
            os.kill(pid_of(worker), signal.SIGCONT)
        reading.join(60)
        got = reading.streams[0]
        assert got.indexes == list(range(60)) and got.text == expected
        assert dispatched_to(stack.url, got.request_id) == [worker, worker]
        # An assignment the scheduler had freed, its HDEL dropped: removed, and nothing runs.
        client.hset(keys.assigned(worker), "freed", encode(Submit("freed", SamplingParams()), 1 << 20))
        wait_for(lambda: not client.hexists(keys.assigned(worker), "freed"), 20, "the stray assignment removed")
        long.join(60)
        assert long.streams[0].indexes == list(range(400))
        assert client.hlen(keys.assigned(worker)) == 0 and stack.stack.exited() == []
