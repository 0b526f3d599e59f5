"""End to end: real redis-server, gateway, scheduler and two workers as separate
processes, the real default model, real HTTP and SSE."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from common.keys import PAYLOAD
from common.protocol import Heartbeat, decode
from tests.conftest import RunningStack, trace, wait_for
from tests.sse import events, stream

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [
    "The quick brown",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Paris is",
    "def fibonacci(n):",
    "The three primary colours are red,",
    "In 1905 Albert Einstein published four papers that",
]


def heartbeats(stack: RunningStack) -> list[Heartbeat]:
    ids = sorted(m.decode() for m in stack.redis.smembers(stack.keys.workers))
    raw = stack.redis.mget([stack.keys.heartbeat(i) for i in ids])
    return [decode(r, Heartbeat, 1 << 20) for r in raw if r is not None]


def completion(client: httpx.Client, prompt: str, max_tokens: int = 16) -> str:
    response = client.post("/generate", json={"prompt": prompt, "max_tokens": max_tokens, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()["text"]


def test_stream_sends_one_event_per_token_then_a_final_event(stack: RunningStack) -> None:
    with stack.client() as client:
        request_id, got = stream(client, {"prompt": "The quick brown", "max_tokens": 8, **GREEDY})
    tokens, final = got[:-1], got[-1]
    assert [e.data["index"] for e in tokens] == list(range(8))
    assert [e.id for e in tokens] == [str(i) for i in range(8)]
    assert all(e.data["sequence_id"] == request_id and isinstance(e.data["token"], str) for e in tokens)
    assert "".join(e.data["token"] for e in tokens).strip()
    assert final.data == {"sequence_id": request_id, "finish_reason": "length", "prompt_tokens": 3,
                          "completion_tokens": 8}


def test_stream_text_equals_the_whole_completion(stack: RunningStack) -> None:
    with stack.client() as client:
        _, got = stream(client, {"prompt": PROMPTS[1], "max_tokens": 12, **GREEDY})
        assert "".join(e.data["token"] for e in got[:-1]) == completion(client, PROMPTS[1], 12)


def test_generate_list_returns_one_completion_per_prompt_in_order(stack: RunningStack) -> None:
    prompts = PROMPTS[:3]
    with stack.client() as client:
        solo = [completion(client, p, 10) for p in prompts]
        response = client.post("/generate", json={"prompts": prompts, "max_tokens": 10, **GREEDY})
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["text"] for r in results] == solo
    assert all(r["finish_reason"] == "length" and r["completion_tokens"] == 10 for r in results)
    assert len({r["sequence_id"] for r in results}) == 3


def test_concurrent_streams_each_get_only_their_own_tokens(stack: RunningStack) -> None:
    bodies = [{"prompt": p, "max_tokens": 12, **GREEDY} for p in PROMPTS[:2]]
    with stack.client() as client:
        solo = [completion(client, b["prompt"], 12) for b in bodies]
        with ThreadPoolExecutor(2) as pool:
            streamed = list(pool.map(lambda body: stream(client, body), bodies))
    for (request_id, got), expected in zip(streamed, solo, strict=True):
        assert {e.data["sequence_id"] for e in got} == {request_id}
        assert "".join(e.data["token"] for e in got[:-1]) == expected


def test_greedy_output_is_the_same_alone_and_in_a_batch_across_two_workers(stack: RunningStack) -> None:
    """Six prompts of different lengths at once share batches on both workers;
    each text must equal that prompt's text generated alone."""
    with stack.client() as client:
        solo = [completion(client, p, 24) for p in PROMPTS]
        before = {b.worker_id: b.finished_total for b in heartbeats(stack)}
        response = client.post("/generate", json={"prompts": PROMPTS, "max_tokens": 24, **GREEDY})
    assert [r["text"] for r in response.json()["results"]] == solo

    def both_workers_served() -> bool:
        after = {b.worker_id: b.finished_total for b in heartbeats(stack)}
        return len(after) == 2 and all(after[w] > before.get(w, 0) for w in after)

    wait_for(both_workers_served, 5, "both workers to report finished requests")


def test_a_client_that_disconnects_frees_its_slot(stack: RunningStack) -> None:
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, **GREEDY}
    with stack.client() as client, client.stream("POST", "/generate_stream", json=body) as response:
        request_id = response.headers["x-request-id"]
        # Held in a name: a dropped generator would be collected at once and close the connection early.
        received = events(response)
        for event in received:
            if event.data["index"] >= 2:
                break
        wait_for(lambda: sum(b.running for b in heartbeats(stack)) >= 1, 30, "the request to run")
    # 2000 tokens would take minutes; the slot must be free soon after the disconnect (the generous bound
    # leaves room for a busy machine, where what an earlier test left running may also take a while).
    wait_for(lambda: sum(b.running for b in heartbeats(stack)) == 0, 30, "the worker to drop the request")
    # On a fast host 2000 tokens fit in that wait: what freed the slot must be the cancel, not the stream's end. The
    # heartbeat may count the slot free a moment before the worker's hop that released it lands: awaited.

    def released_by() -> str | None:
        hops = [event["hop"] for event in trace(stack.url, request_id) if event["service"] == "worker"]
        return hops[-1] if hops and hops[-1] in ("cancelled", "finished", "failed") else None

    ended = wait_for(released_by, 10, "the worker's hop that released the request")
    assert ended == "cancelled", ended


def test_bad_input_gets_a_clear_400_and_the_service_keeps_serving(stack: RunningStack) -> None:
    with stack.client() as client:
        for body in ({}, {"prompt": ""}, {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": -1},
                     {"prompt": "x", "top_p": 0}, {"prompt": "x", "prompts": ["y"]}, {"prompt": 3}):
            response = client.post("/generate", json=body)
            assert response.status_code == 400, body
            assert response.json()["error"]["message"]
        response = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "json_invalid"
        assert completion(client, "Paris is", 3)


def test_a_prompt_longer_than_the_context_is_a_400_before_any_event(stack: RunningStack) -> None:
    """The gateway holds the headers until the first result, so a request the worker
    refuses still gets its HTTP status, streaming or not."""
    body = {"prompt": "word " * 9000, "max_tokens": 4}
    with stack.client() as client:
        for route in ("/generate_stream", "/generate"):
            response = client.post(route, json=body)
            assert response.status_code == 400, route
            assert response.json()["error"]["code"] == "context_length_exceeded"


def test_malformed_bus_messages_are_dropped_and_consumers_keep_running(stack: RunningStack) -> None:
    stack.redis.xadd(stack.keys.requests, {PAYLOAD: b"\xc1 not msgpack"})
    stack.redis.xadd(stack.keys.requests, {b"other": b"field"})
    for beat in heartbeats(stack):
        stack.redis.xadd(stack.keys.inbox(beat.worker_id), {PAYLOAD: b"\x93\x01\x02\x03"})
    with stack.client() as client:
        assert completion(client, "Paris is", 3)
    assert not stack.stack.exited()


def test_health_reports_redis_and_live_workers(stack: RunningStack) -> None:
    body = httpx.get(f"{stack.url}/health").json()
    assert body["redis"] is True
    assert body["workers"] == 2
    served = httpx.get(f"{stack.url}/v1/models").json()["data"][0]
    assert (served["engines"], served["weights"]) == (["hf"], ["gguf"])  # the default model on its file's blocks
