"""Retries that do not run twice (gateway/idempotency.py), on a real redis-server, two real gateways, a scheduler and
an ENGINE=sim worker as processes, over real HTTP and SSE: a retry with the same Idempotency-Key and body gets the
first request's answer or follows its stream from the start, on either gateway, while the first still runs or
after its client left; another body is a 409; keys belong to their API key; a first request that was cancelled or
refused leaves its key to the next try."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from common.clients import sync_client
from common.keys import Keys
from harness.stacks import PrivateStack
from tests.conftest import sim_stack, wait_for
from tests.sse import Streamed, read

NAMESPACE = "idem"
KEYS = Keys(NAMESPACE)
GRACE = 3.0
SETTINGS = {"SIM_STEP_MS": "20", "SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": "16", "API_KEYS": "alpha,beta",
            "RESUME_GRACE": str(GRACE), "RESUME_TTL": "60", "NAMESPACE": NAMESPACE}
ALPHA = {"Authorization": "Bearer alpha"}
BETA = {"Authorization": "Bearer beta"}


@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    with sim_stack(1, gateways=2, **SETTINGS) as running:
        yield running


@pytest.fixture(scope="module")
def store(sim: PrivateStack) -> redis.Redis:
    return sync_client(sim.redis_url)


def keyed(key: str, auth: dict = ALPHA) -> dict:
    return {**auth, "Idempotency-Key": key}


def body(prompt: str, tokens: int = 30, stream: bool = False) -> dict:
    return {"model": "sim", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def post(url: str, payload: dict, headers: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=timeout)


def logs(store: redis.Redis) -> set[str]:
    """The results logs in Redis: one per admitted request that keeps one (every keyed or streamed request here).
    A test compares the set after its requests with the one before: an earlier test's log expiring meanwhile takes
    nothing from the difference, which holds the logs of this test's requests alone."""
    return {key.decode() for key in store.scan_iter(f"{NAMESPACE}:log:*")}


def streamed_text(got: Streamed) -> str:
    return "".join(e.data["choices"][0]["text"] for e in got.events if e.data.get("choices"))


def test_a_retried_whole_answer_is_the_first_one_not_a_second_run(sim: PrivateStack, store: redis.Redis) -> None:
    before = logs(store)
    first = post(sim.urls[0], body("retry me"), keyed("whole-1"))
    again = post(sim.urls[1], body("retry me"), keyed("whole-1"))  # the other gateway
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json() == first.json()
    assert again.headers["x-request-id"] == first.headers["x-request-id"]
    assert first.json()["usage"]["completion_tokens"] == 30
    assert logs(store) - before == {KEYS.log(first.headers["x-request-id"])}  # admitted once
    fresh = post(sim.urls[0], body("retry me"), keyed("whole-2"))  # a new key is a new request
    assert fresh.json()["id"] != first.json()["id"]


def test_a_retry_follows_the_running_stream_from_its_start(sim: PrivateStack) -> None:
    payload = body("follow me", tokens=60, stream=True)
    first = Streamed()
    reader = threading.Thread(target=read, args=(sim.urls[0], "/v1/completions"),
                              kwargs={"body": payload, "headers": keyed("stream-1"), "into": first})
    reader.start()
    wait_for(lambda: len(first.events) >= 5, 30, "the first stream's first events")
    again = read(sim.urls[1], "/v1/completions", body=payload, headers=keyed("stream-1"))
    reader.join(60)
    assert again.status == 200 and again.request_id == first.request_id
    assert again.ended == first.ended == "done" and again.events[-1].done
    assert streamed_text(again) == streamed_text(first) and len(streamed_text(first)) > 0
    assert [e.data for e in again.events] == [e.data for e in first.events]


def test_the_same_key_with_another_body_is_a_409_naming_the_header(sim: PrivateStack) -> None:
    assert post(sim.urls[0], body("one body"), keyed("clash")).status_code == 200
    clash = post(sim.urls[1], body("another body"), keyed("clash"))
    assert clash.status_code == 409
    assert clash.json()["error"]["param"] == "Idempotency-Key"
    assert clash.json()["error"]["code"] == "idempotency_conflict"
    chat = httpx.post(f"{sim.url}/v1/chat/completions", headers=keyed("clash"), timeout=30,
                      json={"model": "sim", "messages": [{"role": "user", "content": "one body"}], "max_tokens": 3})
    assert chat.status_code == 409  # the same key on another route


def test_a_key_belongs_to_its_api_key(sim: PrivateStack) -> None:
    alpha = post(sim.url, body("shared key"), keyed("mine", ALPHA))
    beta = post(sim.url, body("shared key"), keyed("mine", BETA))
    assert alpha.status_code == beta.status_code == 200
    assert alpha.json()["id"] != beta.json()["id"]


@pytest.mark.parametrize("key", ["x" * 256, "tab\there", "ключ"])
def test_a_malformed_key_is_a_400_naming_the_header(sim: PrivateStack, key: str) -> None:
    headers = {**ALPHA, "Idempotency-Key": key}
    answer = httpx.post(f"{sim.url}/v1/completions", json=body("bad key"), timeout=30,
                        headers={k: v.encode() if k == "Idempotency-Key" else v for k, v in headers.items()})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "Idempotency-Key"


def test_a_retry_after_the_client_timed_out_takes_the_answer_still_being_made(sim: PrivateStack,
                                                                             store: redis.Redis) -> None:
    """The client gives up mid-answer (its timeout); the request runs on within RESUME_GRACE, and the retry gets it
    whole without a second run."""
    payload = body("slow answer", tokens=80)
    before = logs(store)
    sent = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        post(sim.urls[0], payload, keyed("timeout-1"), timeout=0.6)
    again = post(sim.urls[1], payload, keyed("timeout-1"))
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["completion_tokens"] == 80
    assert logs(store) - before == {KEYS.log(again.headers["x-request-id"])}  # admitted once
    # 80 steps of 20 ms: a second run after the retry arrived would take as long again.
    assert time.monotonic() - sent < 0.6 + 80 * 0.020 * 1.9


def test_a_cancelled_first_request_leaves_its_key_to_the_retry(sim: PrivateStack) -> None:
    payload = body("cancel me", tokens=200, stream=True)
    first = read(sim.urls[0], "/v1/completions", body=payload, headers=keyed("cancelled-1"), upto=3)
    assert httpx.delete(f"{sim.url}/v1/requests/{first.request_id}", headers=ALPHA, timeout=30).status_code == 204
    again = read(sim.urls[1], "/v1/completions", body=payload, headers=keyed("cancelled-1"))
    assert again.status == 200 and again.ended == "done"
    assert again.request_id != first.request_id and len(again.events) > 200


def test_a_first_request_that_fails_leaves_its_key_to_the_retry(sim: PrivateStack) -> None:
    """Refused by its worker (a prompt past the context), after the key was claimed: a retry with a good body is a
    new request, not a 409."""
    too_long = post(sim.url, body("word " * 9000), keyed("refused-1"))
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert post(sim.url, body("a good body"), keyed("refused-1")).status_code == 200


def test_the_seed_routes_take_the_key_too(sim: PrivateStack) -> None:
    payload = {"prompt": "seed route", "max_tokens": 12, "ignore_eos": True}
    first = httpx.post(f"{sim.urls[0]}/generate", json=payload, headers=keyed("seed-1"), timeout=60)
    again = httpx.post(f"{sim.urls[1]}/generate", json=payload, headers=keyed("seed-1"), timeout=60)
    assert first.status_code == again.status_code == 200 and again.json() == first.json()
    streamed = read(sim.urls[0], "/generate_stream", body=payload, headers=keyed("seed-2"))
    followed = read(sim.urls[1], "/generate_stream", body=payload, headers=keyed("seed-2"))
    assert followed.request_id == streamed.request_id and followed.text == streamed.text
    assert len(followed.tokens) == 12 and followed.ended == "done"
