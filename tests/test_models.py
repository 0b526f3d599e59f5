"""Several models behind one gateway. The policy, pure: a request runs only on a worker that answers to its
model, and a model without room holds up no other. A sim stack with two models (real redis-server, the
services as processes, real HTTP; ENGINE=sim workers answering to `alpha` (two) and `beta` (one)): each
answer comes from a worker of its model, a lost worker's streams move only to its model's other worker, a
model whose workers are all gone makes its requests wait and time out while the other keeps serving, a
worker handed a request for another model returns it to the queue, and each model's figures are its own."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.clients import sync_client
from common.keys import PAYLOAD, Keys
from common.protocol import Batch, Heartbeat, ModelLoad, SamplingParams, Submit, decode, encode
from harness.stacks import PrivateStack, private_stack
from llmserve.launcher import worker_counts
from llmserve.processes import free_port, wait_until
from scheduler.policy import Queued, WaitingQueue, WorkerState, model_figures, plan
from tests.conftest import dispatched_to, pid_of
from tests.sse import events

LIMIT = 1 << 20
NAMESPACE = "models"
SETTINGS = {"ENGINE": "sim", "SIM_STEP_MS": "20", "SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": "8",
            "NAMESPACE": NAMESPACE, "HEARTBEAT_INTERVAL": "0.2", "WORKER_TTL": "1.5", "LOG_LEVEL": "WARNING"}


# The policy.

def queued(rid: str, model: str, tenant: str = "t", at: float = 0.0) -> Queued:
    return Queued(Submit(rid, SamplingParams(), prompt="p", submitted_at=at, tenant=tenant, model=model),
                  rid.encode(), 100)


def test_each_request_goes_only_to_a_worker_of_its_model_and_unnamed_ones_anywhere() -> None:
    queue = WaitingQueue()
    for i in range(6):
        queue.add(queued(f"a{i}", "alpha", at=i))
        queue.add(queued(f"b{i}", "beta", at=i + 0.5))
    queue.add(queued("any", "", at=99))
    workers = [WorkerState("wa", 16, models=frozenset({"alpha"})), WorkerState("wb", 16, models=frozenset({"beta"}))]
    batches = plan(queue, workers, LIMIT)
    went = {rid: worker for worker, batch in batches for rid in (q.request_id for q in batch)}
    assert {rid for rid, worker in went.items() if worker == "wa"} >= {f"a{i}" for i in range(6)}
    assert {rid for rid, worker in went.items() if worker == "wb"} >= {f"b{i}" for i in range(6)}
    assert "any" in went and not queue


def test_a_model_without_room_holds_up_no_other_model() -> None:
    queue = WaitingQueue()
    for i in range(4):
        queue.add(queued(f"a{i}", "alpha", at=i))  # the oldest requests, of a model whose worker is full
    queue.add(queued("b0", "beta", at=10))
    full = WorkerState("wa", 2, assigned={"x": "t", "y": "t"}, models=frozenset({"alpha"}))
    batches = plan(queue, [full, WorkerState("wb", 2, models=frozenset({"beta"}))], LIMIT)
    assert [(worker, [q.request_id for q in batch]) for worker, batch in batches] == [("wb", ["b0"])]
    assert [q.request_id for q in queue] == ["a0", "a1", "a2", "a3"]  # still in order for their model


def test_a_moved_request_waits_for_a_worker_of_its_model_without_blocking_the_others() -> None:
    queue = WaitingQueue()
    moved = queued("moved", "beta")
    moved.submit.migrations = 1
    queue.add(moved)
    queue.add(queued("a0", "alpha"))
    batches = plan(queue, [WorkerState("wa", 4, models=frozenset({"alpha"}))], LIMIT)
    assert [q.request_id for _, batch in batches for q in batch] == ["a0"]
    assert [q.request_id for q in queue] == ["moved"]


def test_each_models_figures_count_its_own_requests_and_workers() -> None:
    figures = model_figures(Counter({"alpha": 3, "": 1}), Counter({"beta": 2}),
                            [frozenset({"alpha"}), frozenset({"alpha", "alpha-chat"}), frozenset({"beta"})])
    assert figures == {"alpha": ModelLoad(3, 0, 2), "alpha-chat": ModelLoad(0, 0, 1), "beta": ModelLoad(0, 2, 1)}


def test_the_launchers_worker_counts() -> None:
    assert worker_counts("3") == 3
    assert worker_counts("a=2,b=1,a=1") == {"a": 3, "b": 1}
    for wrong in ("x", "a=0", "=2", "a=2,3", "a=-1"):
        with pytest.raises(ValueError, match="--workers"):
            worker_counts(wrong)


# A sim stack with two models.

@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    settings = {**SETTINGS, "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port())}
    with private_stack({"alpha": 2, "beta": 1}, **settings) as running:
        yield running


def heartbeats(stack: PrivateStack) -> dict[str, Heartbeat]:
    return {beat.worker_id: beat for beat in heartbeats_of(stack, NAMESPACE)}


def workers_serving(stack: PrivateStack, model: str) -> set[str]:
    """The live workers that answer to `model` (a request's workers are conftest's `workers_of`)."""
    return {worker_id for worker_id, beat in heartbeats(stack).items() if model in beat.serves()}


def complete(stack: PrivateStack, model: str, tokens: int = 4, timeout: float | None = None) -> httpx.Response:
    body = {"model": model, "prompt": f"to {model}", "max_tokens": tokens}
    if timeout is not None:
        body["timeout"] = timeout
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)


def test_fifty_mixed_requests_are_each_answered_by_a_worker_of_their_model(sim: PrivateStack) -> None:
    asked = ["alpha" if i % 3 else "beta" for i in range(50)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda model: complete(sim, model), asked))
    assert [a.status_code for a in answers] == [200] * 50
    assert [a.json()["model"] for a in answers] == asked
    owners = {model: workers_serving(sim, model) for model in ("alpha", "beta")}
    assert len(owners["alpha"]) == 2 and len(owners["beta"]) == 1
    wrong = [(model, answer.headers["x-request-id"]) for model, answer in zip(asked, answers, strict=True)
             if not set(dispatched_to(sim.url, answer.headers["x-request-id"])) <= owners[model]]
    assert not wrong


def test_models_lists_each_name_once_with_its_workers_and_health_gives_each_models_figures(
        sim: PrivateStack) -> None:
    listed = {m["id"]: m for m in httpx.get(f"{sim.url}/v1/models").json()["data"]}
    assert sorted(listed) == ["alpha", "beta"]
    assert listed["alpha"]["workers"] == 2 and listed["beta"]["workers"] == 1
    assert listed["alpha"]["engines"] == ["sim"] and listed["alpha"]["weights"] == ["sim"]  # what serves it
    beta = httpx.get(f"{sim.url}/health", params={"model": "beta"}).json()
    assert beta["model"] == "beta" and beta["workers"] == 1 and beta["slots"] == 8 and beta["waiting"] == 0
    assert httpx.get(f"{sim.url}/health").json()["workers"] == 3
    assert httpx.post(f"{sim.url}/v1/completions", json={"model": "gamma", "prompt": "x"}).status_code == 404


def test_a_request_for_another_model_handed_to_a_worker_goes_back_to_the_queue(sim: PrivateStack) -> None:
    """What an older scheduler, or a race with a restart, could do: the scheduler's own steps, by hand."""
    client, keys = sync_client(sim.redis_url), Keys(NAMESPACE)
    alpha = sorted(workers_serving(sim, "alpha"))[0]
    submit = Submit("misrouted", SamplingParams(max_tokens=3), prompt="wrong door", submitted_at=time.time(),
                    model="beta", tenant="t")
    client.hset(keys.assigned(alpha), "misrouted", encode(submit, LIMIT))
    client.xadd(keys.inbox(alpha), {PAYLOAD: encode(Batch("by-hand", [submit]), LIMIT)})

    def hops() -> list[tuple[str, str | None]]:
        events = httpx.get(f"{sim.url}/v1/requests/misrouted/trace").json().get("events", [])
        return [(e["hop"], e["detail"].get("worker_id")) for e in events]

    wait_until(lambda: any(hop == "finished" for hop, _ in hops()), 20, "the returned request to finish", 0.2)
    [beta] = workers_serving(sim, "beta")
    assert ("returned", alpha) in hops()
    assert ("finished", beta) in hops() and ("finished", alpha) not in hops()


def test_the_schedulers_metrics_are_per_model(sim: PrivateStack) -> None:
    port = sim.stack.env["SCHEDULER_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    for name in ("vllm:num_requests_waiting", "llmserve_scheduler_running", "llmserve_scheduler_model_workers"):
        labelled = {line.split('model_name="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith(name + "{")}
        assert labelled == {"alpha", "beta"}, (name, labelled)
    assert 'llmserve_scheduler_model_workers{model_name="alpha"} 2.0' in text


def stream_text(url: str, model: str, tokens: int) -> tuple[str, str]:
    """A streamed completion of `tokens` tokens: its request_id and its text."""
    body = {"model": model, "prompt": f"long {model}", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
        chunks = [event.data for event in events(response) if not event.done]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return chunks[0]["id"].removeprefix("cmpl-"), text


def test_a_lost_workers_streams_move_to_its_models_other_worker_only(sim: PrivateStack) -> None:
    alpha = sorted(workers_serving(sim, "alpha"))
    [beta] = workers_serving(sim, "beta")
    victim = alpha[0]
    pid = pid_of(victim)
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream_text, sim.url, "alpha", 120) for _ in range(6)]
        wait_until(lambda: heartbeats(sim)[victim].running >= 1, 10, "a stream on the victim", 0.05)
        os.kill(pid, signal.SIGKILL)
        ended = [stream.result() for stream in streams]
    assert all(len(text) > 0 for _, text in ended)
    moved = [dispatched_to(sim.url, rid) for rid, _ in ended]
    assert any(len(hops) == 2 and hops[0] == victim for hops in moved)
    for hops in moved:
        assert beta not in hops
        assert set(hops[1:]) <= {alpha[1]}
    sim.stack.processes = [(n, p) for n, p in sim.stack.processes if p.pid != pid]


def test_a_model_whose_workers_are_gone_waits_and_times_out_while_the_other_serves(sim: PrivateStack) -> None:
    [beta] = workers_serving(sim, "beta")
    pid = pid_of(beta)
    os.kill(pid, signal.SIGKILL)
    sim.stack.processes = [(n, p) for n, p in sim.stack.processes if p.pid != pid]
    wait_until(lambda: not workers_serving(sim, "beta"), 10, "beta's worker to be gone", 0.1)
    with ThreadPoolExecutor(4) as pool:
        waiting = pool.submit(complete, sim, "beta", 4, 3.0)
        health = wait_until(lambda: (h := httpx.get(f"{sim.url}/health", params={"model": "beta"}).json())["waiting"]
                            and h, 2.5, "the scheduler to count beta's request as waiting", 0.05)
        served = [pool.submit(complete, sim, "alpha") for _ in range(3)]
        assert [s.result().status_code for s in served] == [200] * 3
        timed_out = waiting.result()
    assert health["workers"] == 0 and health["waiting"] == 1  # what scales beta's workers up from zero
    assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "queue_timeout"
    # Still listed while configured (MODELS), though no worker serves it now.
    assert "beta" in [m["id"] for m in httpx.get(f"{sim.url}/v1/models").json()["data"]]


# The real model under two names, on two weight formats.

TWO_NAMES = {"gguf": "smol-gguf", "int8": "smol-int8"}


@pytest.fixture(scope="module")
def two_names() -> Iterator[PrivateStack]:
    settings = {"NAMESPACE": "names", "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
                "LOG_LEVEL": "WARNING", "MODELS": ",".join(TWO_NAMES.values()),
                "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port())}
    with private_stack(0, **settings) as running:
        for quant, name in TWO_NAMES.items():
            running.stack.spawn("worker", SERVED_MODEL_NAME=name, WORKER_QUANT=quant)
        wait_until(lambda: httpx.get(f"{running.url}/health").json()["workers"] == 2, 300, "both workers", 0.5)
        yield running


def test_the_real_model_under_two_names_answers_each_from_its_own_worker(two_names: PrivateStack) -> None:
    names = list(TWO_NAMES.values())
    asked = [names[i % 2] for i in range(50)]
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda model: httpx.post(f"{two_names.url}/v1/completions",
                                                         json={**body, "model": model}, timeout=120), asked))
    assert [a.status_code for a in answers] == [200] * 50
    assert [a.json()["model"] for a in answers] == asked
    beats = {beat.worker_id: beat for beat in heartbeats_of(two_names, "names")}
    owner = {name: worker for worker, beat in beats.items() for name in beat.serves()}
    assert sorted(owner) == sorted(names)
    for model, answer in zip(asked, answers, strict=True):
        assert dispatched_to(two_names.url, answer.headers["x-request-id"]) == [owner[model]]
    # Greedy, one text per name: each worker's own weights.
    texts = {model: {a.json()["choices"][0]["text"] for m, a in zip(asked, answers, strict=True) if m == model}
             for model in names}
    assert all(len(t) == 1 for t in texts.values()), texts


def heartbeats_of(stack: PrivateStack, namespace: str) -> list[Heartbeat]:
    client, keys = sync_client(stack.redis_url), Keys(namespace)
    ids = [m.decode() for m in client.smembers(keys.workers)]
    return [decode(raw, Heartbeat, LIMIT) for raw in client.mget([keys.heartbeat(i) for i in ids]) if raw]
