"""ENGINE=sim workers: the control plane at scale without the model (no model load,
so a four-worker stack starts in seconds)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from common.keys import Keys
from common.protocol import Heartbeat, SamplingParams, Submit, decode
from tests.conftest import sim_stack, trace, wait_for
from tests.sse import events
from worker.core import PromptInvalid
from worker.sim import VOCAB, SimEngine, SimModel, sim_token


def test_the_sim_engine_batches_and_is_batch_invariant() -> None:
    model = SimModel()
    engine = SimEngine(model, slots=2, step_s=0, per_sequence_s=0)
    prompts = {"a": "one two three", "b": "four five", "c": "six"}
    for rid, prompt in prompts.items():
        engine.add(rid, model.prompt_ids(Submit(rid, SamplingParams(), prompt=prompt)), SamplingParams(max_tokens=3))
    first = engine.step().outputs
    assert [o.request_id for o in first] == ["a", "b"] and len(engine.waiting) == 1
    texts: dict[str, str] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
    assert texts["c"] == "".join(VOCAB[sim_token(1 + i)] for i in range(3))
    assert engine.cancel("zzz") is False


def test_a_prompt_of_token_ids_is_taken_as_it_is_within_the_vocabulary() -> None:
    model = SimModel()
    assert model.prompt_ids(Submit("r", SamplingParams(), prompt_token_ids=[3, 1, 4])) == [3, 1, 4]
    with pytest.raises(PromptInvalid, match=f"names token {len(VOCAB)};"):
        model.prompt_ids(Submit("r", SamplingParams(), prompt_token_ids=[1, len(VOCAB)]))


def test_many_streams_over_four_sim_workers() -> None:
    with sim_stack(4, SIM_STEP_MS="5") as running:
        body = {"prompt": "hello there", "max_tokens": 20}

        def one(_: int) -> httpx.Response:
            return httpx.post(f"{running.url}/generate", json=body, timeout=60)

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(one, range(64)))
        expected = "".join(VOCAB[sim_token(2 + i)] for i in range(20))
        assert all(a.status_code == 200 and a.json()["text"] == expected for a in answers)
        workers = httpx.get(f"{running.url}/v1/cluster").json()["workers"]
        assert len(workers) == 4 and all(w["model"] == "sim" for w in workers)
        r = redis.Redis.from_url(running.redis_url)

        def counted() -> list[int] | None:
            """Each worker's finished requests, once their heartbeats (up to an interval behind) count the burst."""
            counts = [decode(r.get(Keys("llmserve").heartbeat(w["id"])), Heartbeat, 1 << 20).finished_total
                      for w in workers]
            return counts if sum(counts) == 64 else None

        counts = wait_for(counted, 10, "the heartbeats to count the burst")
        assert all(counts), counts  # it spread over every worker


def test_what_reaches_a_generating_worker_is_taken_in_between_its_steps() -> None:
    """A worker that is generating reads its inbox between its steps: a request that arrives mid-stream joins the
    running batch and is answered long before the stream could end, and the stream's cancel, when its client
    leaves, frees its slot long before the stream could end on its own."""
    tokens, step_s = 5000, 0.020
    with sim_stack(1, SIM_STEP_MS=str(step_s * 1000), RESUME_GRACE="1") as running:
        keys, r = Keys("llmserve"), redis.Redis.from_url(running.redis_url)
        body = {"prompt": "hello", "max_tokens": tokens, "ignore_eos": True}
        with httpx.Client(base_url=running.url, timeout=60) as client, \
                client.stream("POST", "/generate_stream", json=body) as stream:
            request_id = stream.headers["x-request-id"]
            received = (event for event in events(stream) if "index" in event.data)
            for _ in range(5):
                next(received)
            started = time.monotonic()
            short = client.post("/generate", json={"prompt": "hi", "max_tokens": 3})
            took = time.monotonic() - started
            assert short.status_code == 200 and short.json()["completion_tokens"] == 3
            # A request queued behind the stream would wait for its thousands of steps.
            assert took < 5, took
            next(received)
        left = time.monotonic()

        def running_count() -> int:
            ids = [m.decode() for m in r.smembers(keys.workers)]
            return sum(decode(raw, Heartbeat, 1 << 20).running for raw in r.mget([keys.heartbeat(i) for i in ids]))

        def last_hop() -> str:
            return [e["hop"] for e in trace(running.url, request_id) if e["service"] == "worker"][-1]

        # The heartbeat may count the slot free a moment before the worker's `cancelled` hop lands: both awaited.
        wait_for(lambda: running_count() == 0 and last_hop() == "cancelled", 10,
                 "the worker to drop the abandoned stream")
        assert time.monotonic() - left < tokens * step_s / 4  # so it cannot have ended on its own


def test_static_sim_batching_waits_for_the_whole_batch() -> None:
    model = SimModel()
    engine = SimEngine(model, slots=4, step_s=0, per_sequence_s=0, static=True)
    engine.add("short", [1], SamplingParams(max_tokens=1))
    engine.add("long", [1], SamplingParams(max_tokens=3))
    engine.step()
    engine.add("late", [1], SamplingParams(max_tokens=1))
    assert [o.request_id for o in engine.step().outputs] == ["long"]
    assert [o.request_id for o in engine.step().outputs] == ["long"]
    assert [o.request_id for o in engine.step().outputs] == ["late"]


def test_a_sim_worker_does_not_load_torch() -> None:
    code = "import sys, worker.main, worker.sim; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
