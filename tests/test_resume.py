"""Streams that outlive their connection (real redis-server, real gateways, scheduler and ENGINE=sim
workers as processes, real HTTP and SSE): a client that drops its connection resumes on any gateway
with Last-Event-ID and gets every token after it exactly once (both APIs, n = 1 and n = 2, and as a
browser's EventSource does it), even after kill -9 of its gateway; a stream nobody resumes is
cancelled after RESUME_GRACE; only its key may resume it, until RESUME_TTL. The results log is
bounded in bytes. One check on the real model: the resumed greedy text equals an unbroken run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from common.clients import sync_client
from common.keys import Keys
from common.protocol import Done, Heartbeat, SamplingParams, StreamMeta, Submit, Token, decode, encode
from common.resultlog import LOG_HEAD, publish_results
from common.settings import Settings
from gateway.errors import ApiError
from gateway.sse import format_id, parse_id
from harness.stacks import PrivateStack
from llmserve.processes import free_port, free_ports
from tests.conftest import RunningStack, redis_server, sim_stack, trace, wait_for
from tests.sse import Event, Streamed, read
from tests.sse import events as sse_events
from worker.sim import VOCAB, SimModel, sim_token

ALPHA = {"Authorization": "Bearer alpha"}
BETA = {"Authorization": "Bearer beta"}
GRACE = 1.5
LEASE_INTERVAL = GRACE / 4  # how often a gateway extends the lease of a stream one of its clients reads
TTL = 6.0
NAMESPACE = "resume"
SETTINGS = {"ENGINE": "sim", "SIM_STEP_MS": "10", "SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": "32",
            "API_KEYS": "alpha,beta", "RESUME_GRACE": str(GRACE), "RESUME_TTL": str(TTL), "NAMESPACE": NAMESPACE,
            "HEARTBEAT_INTERVAL": "0.2", "WORKER_TTL": "2", "LOG_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    """Two gateways (consecutive ports) on one Redis, a scheduler, one sim worker."""
    with sim_stack(1, gateways=2, **SETTINGS) as running:
        yield running


def resume(url: str, request_id: str, last_id: str | None, headers: dict = ALPHA, upto: int | None = None) -> Streamed:
    extra = {"Last-Event-ID": last_id} if last_id is not None else {}
    return read(url, f"/v1/requests/{request_id}/stream", headers={**headers, **extra}, upto=upto)


def sim_text(prompt: str, tokens: int) -> str:
    """What a sim worker writes for `prompt`, the same in any batch."""
    length = len(SimModel().prompt_ids(Submit("x", SamplingParams(), prompt=prompt)))
    return "".join(VOCAB[sim_token(length + i)] for i in range(tokens))


def running(stack: PrivateStack) -> int:
    """Sequences the workers run, from their heartbeats (the gateway's /health caches them for a second)."""
    client, keys = sync_client(stack.redis_url), Keys(stack.stack.env["NAMESPACE"])
    ids = [m.decode() for m in client.smembers(keys.workers)]
    beats = [decode(raw, Heartbeat, 1 << 20) for raw in client.mget([keys.heartbeat(i) for i in ids]) if raw]
    return sum(beat.running for beat in beats)


def lease_key(stack: PrivateStack) -> str:
    return Keys(stack.stack.env["NAMESPACE"]).leases


def redis_ms(r: redis.Redis) -> float:
    """Redis's clock, in which leases lapse."""
    seconds, micros = r.time()
    return seconds * 1000 + micros / 1000


def let_go(stack: PrivateStack, request_id: str) -> float:
    """The deadline (Redis's clock, ms) of the stream's lease once no gateway extends it any more: its last
    extension is older than the interval at which a gateway holding it extends it."""
    r = sync_client(stack.redis_url)

    def lapsing() -> float | None:
        deadline = r.zscore(lease_key(stack), request_id)
        if deadline is None or redis_ms(r) < deadline - (GRACE - LEASE_INTERVAL) * 1000:
            return None
        return deadline

    return wait_for(lapsing, 10, "the stream's lease to be left to lapse", interval=0.02)


def seed_tokens(events: list[Event]) -> list[dict]:
    return [e.data for e in events if e.event is None and "token" in e.data]


def test_a_seed_stream_resumes_on_the_other_gateway_with_every_token_once(sim: PrivateStack) -> None:
    first, second = sim.urls
    body = {"prompt": "tell me a story", "max_tokens": 60}
    broken = read(first, "/generate_stream", "POST", body, ALPHA, upto=7)
    rid = broken.headers["x-request-id"]
    assert [e.id for e in broken.events] == [str(i) for i in range(7)]
    assert broken.events[0].retry and broken.events[0].retry <= GRACE * 1000
    rest = resume(second, rid, broken.events[-1].id)
    assert rest.status == 200 and rest.headers["x-request-id"] == rid
    tokens = seed_tokens(broken.events) + seed_tokens(rest.events)
    assert [t["index"] for t in tokens] == list(range(60))  # contiguous across the break: none lost, none twice
    assert "".join(t["token"] for t in tokens) == sim_text(body["prompt"], 60)
    end = rest.events[-1]
    assert end.id == "60" and end.data["finish_reason"] == "length" and end.data["completion_tokens"] == 60
    # The end delivered, there is nothing left: 204, which also stops an EventSource.
    assert resume(second, rid, end.id).status == 204
    # A finished stream replays whole, on either gateway, without Last-Event-ID.
    replay = resume(first, rid, None)
    assert [e.id for e in replay.events] == [str(i) for i in range(61)]
    assert "".join(t["token"] for t in seed_tokens(replay.events)) == sim_text(body["prompt"], 60)


@pytest.mark.parametrize(("path", "n", "prefix"), [("/v1/completions", 1, "cmpl-"),
                                                   ("/v1/chat/completions", 2, "chatcmpl-")])
def test_openai_streams_resume_exactly_with_one_id_for_every_choice(sim: PrivateStack, path: str, n: int,
                                                                    prefix: str) -> None:
    first, second = sim.urls
    body = {"model": "sim", "max_tokens": 40, "n": n, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"prompt": "once upon"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi you"}]}
    whole = httpx.post(f"{first}{path}", json={**body, "stream": False}, headers=ALPHA, timeout=60).json()
    expected = [c["message"]["content"] if "chat" in path else c["text"] for c in whole["choices"]]
    broken = read(first, path, "POST", body, ALPHA, upto=9)
    answer_id = broken.events[0].data["id"]
    assert answer_id.startswith(prefix) and broken.events[0].retry
    assert all(e.id and len(e.id.split(".")) == n for e in broken.events)
    # The answer's id in the URL, and the position as a query parameter this time (no header).
    rest = read(second, f"/v1/requests/{answer_id}/stream?last_event_id={broken.events[-1].id}", headers=ALPHA)
    assert rest.status == 200
    events = broken.events + rest.events
    assert events[-1].done and events[-1].id == "done"
    chunks = [e.data for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 40 * n and chunks[-1]["choices"] == []
    texts, roles, finishes = [""] * n, [0] * n, [0] * n
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        assert chunk["id"] == answer_id
        index = choice["index"]
        if "chat" in path:
            texts[index] += choice["delta"].get("content", "")
            roles[index] += choice["delta"].get("role") == "assistant"
        else:
            texts[index] += choice["text"]
        finishes[index] += choice["finish_reason"] is not None
    assert texts == expected
    assert finishes == [1] * n
    if "chat" in path:
        assert roles == [1] * n  # the role once per choice, not again after the break
    # Each event's id moves one choice by one position.
    positions = [[int(p) for p in e.id.split(".")] for e in events[:-2]]
    for before, after in zip([[-1] * n, *positions], positions, strict=False):
        moved = [b2 - b1 for b1, b2 in zip(before, after, strict=True)]
        assert sorted(moved) == [0] * (n - 1) + [1], (before, after)
    assert resume(second, answer_id, "done").status == 204


def test_an_event_source_reconnects_with_no_code_of_ours(sim: PrivateStack) -> None:
    """What a browser's EventSource does: GET the stream, and after each break GET it again with the last
    id it saw as Last-Event-ID, on whichever gateway; a 204 tells it to stop."""
    started = read(sim.urls[0], "/generate_stream", "POST", {"prompt": "event source", "max_tokens": 50}, ALPHA,
                   upto=1)
    rid = started.headers["x-request-id"]
    seen: list[Event] = []
    last_id: str | None = None
    for attempt in range(40):
        got = resume(sim.urls[attempt % 2], rid, last_id, upto=4 + attempt % 5)
        if got.status == 204:
            break
        assert got.status == 200 and got.events[0].retry
        seen += got.events
        last_id = seen[-1].id
    else:
        pytest.fail("the EventSource never got its 204")
    tokens = seed_tokens(seen)
    assert [t["index"] for t in tokens] == list(range(50))
    assert "".join(t["token"] for t in tokens) == sim_text("event source", 50)
    assert seen[-1].data["finish_reason"] == "length"


def test_only_the_key_that_created_a_stream_may_resume_it(sim: PrivateStack) -> None:
    first, second = sim.urls
    broken = read(first, "/v1/completions", "POST", {"model": "sim", "prompt": "mine", "max_tokens": 30, "n": 2,
                                                     "stream": True}, ALPHA, upto=2)
    rid = broken.headers["x-request-id"]
    for url in (first, second):
        other = resume(url, rid, broken.events[-1].id, headers=BETA)
        assert other.status == 404 and json.loads(other.body)["error"]["code"] == "stream_not_found"
        assert resume(url, "0" * 32, None).status == 404  # unknown: the same answer
        assert resume(url, rid, None, headers={}).status == 401
    # The second choice's request_id does not name the stream: the same 404.
    header = sync_client(sim.redis_url).lindex(Keys(NAMESPACE).log(rid), LOG_HEAD - 1)
    assert resume(first, decode(header, StreamMeta, 1 << 20).request_ids[1], None).status == 404
    rest = resume(second, rid, broken.events[-1].id)
    assert rest.status == 200 and rest.events[-1].done
    bad = resume(second, rid, "3")  # one position for two choices
    assert bad.status == 400 and json.loads(bad.body)["error"]["param"] == "Last-Event-ID"


def test_a_finished_stream_replays_until_its_ttl_ends(sim: PrivateStack) -> None:
    done = read(sim.urls[0], "/generate_stream", "POST", {"prompt": "short", "max_tokens": 5}, ALPHA)
    rid = done.headers["x-request-id"]
    assert [e.raw for e in resume(sim.urls[1], rid, None).events] == [e.raw for e in done.events]
    gone = wait_for(lambda: (g := resume(sim.urls[1], rid, None)).status != 200 and g, TTL + 5,
                    "the finished stream's log to expire", 0.2)
    assert gone.status == 404 and json.loads(gone.body)["error"]["code"] == "stream_not_found"


def test_a_stream_nobody_resumes_is_cancelled_after_the_grace(sim: PrivateStack) -> None:
    url = sim.urls[0]
    r = sync_client(sim.redis_url)
    wait_for(lambda: running(sim) == 0, 20, "an idle worker")
    broken = read(url, "/generate_stream", "POST", {"prompt": "abandoned", "max_tokens": 5000}, ALPHA, upto=3)
    left = time.monotonic()
    rid = broken.headers["x-request-id"]
    lapses_at = let_go(sim, rid)
    assert running(sim) == 1 and redis_ms(r) < lapses_at, "the request must keep running during the grace period"
    wait_for(lambda: running(sim) == 0, GRACE + 10, "the abandoned request to be cancelled", interval=0.05)
    freed = time.monotonic() - left
    print(f"abandoned stream cancelled, its slot freed {freed:.2f} s after its client left (RESUME_GRACE={GRACE})")
    assert redis_ms(r) >= lapses_at  # cancelled once its lease lapsed, not when its client left
    # Resuming it later still gives every token it made, then why it ended.
    rest = resume(sim.urls[1], rid, broken.events[-1].id)
    tokens = seed_tokens(rest.events)
    assert tokens and tokens[0]["index"] == 3
    assert [t["index"] for t in tokens] == list(range(3, 3 + len(tokens)))
    assert rest.events[-1].event == "error" and rest.events[-1].data["error"]["code"] == "cancelled"


def test_a_grace_of_zero_cancels_when_the_client_leaves() -> None:
    """RESUME_GRACE=0 keeps the behaviour from before resume: a disconnect cancels the request at once."""
    with sim_stack(1, **{**SETTINGS, "RESUME_GRACE": "0", "NAMESPACE": "resume-off"}) as stack, \
            httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{stack.urls[0]}/generate_stream", json={"prompt": "gone", "max_tokens": 5000},
                           headers=ALPHA) as response:
            events = sse_events(response)
            assert [next(events).id for _ in range(3)] == ["0", "1", "2"]
            wait_for(lambda: running(stack) == 1, 10, "the worker to report the request")
            assert sync_client(stack.redis_url).zcard(lease_key(stack)) == 0  # no lease: nothing waits for it
            rid = response.headers["x-request-id"]
        left = time.monotonic()
        wait_for(lambda: running(stack) == 0, 10, "the request to be cancelled", interval=0.05)
        print(f"RESUME_GRACE=0: slot freed {time.monotonic() - left:.2f} s after the client left")
        hops = [e["hop"] for e in trace(stack.url, rid, ALPHA) if e["service"] == "gateway"]
        assert "cancelled" in hops and "detached" not in hops  # cancelled as it left, not left to a grace


def test_a_client_back_within_the_grace_keeps_its_request_and_delete_cancels_it(sim: PrivateStack) -> None:
    first, second = sim.urls
    r = sync_client(sim.redis_url)
    wait_for(lambda: running(sim) == 0, 20, "an idle worker")
    broken = read(first, "/generate_stream", "POST", {"prompt": "kept", "max_tokens": 5000}, ALPHA, upto=3)
    rid = broken.headers["x-request-id"]
    lapses_at = let_go(sim, rid)  # left to lapse: back any time before it
    with httpx.Client(timeout=60) as client, client.stream(
            "GET", f"{second}/v1/requests/{rid}/stream", headers={**ALPHA, "Last-Event-ID": broken.events[-1].id}
    ) as response:
        events = sse_events(response)
        got = [next(events)]
        assert (r.zscore(lease_key(sim), rid) or 0) > lapses_at, "coming back did not extend the stream's lease"
        for event in events:  # read on past the moment the lease would have lapsed without this client
            got.append(event)
            if redis_ms(r) > lapses_at + LEASE_INTERVAL * 1000:
                break
        assert running(sim) == 1, "a stream read again must outlive its first lease"
        assert client.delete(f"{first}/v1/requests/{rid}", headers=BETA).status_code == 404
        assert client.delete(f"{first}/v1/requests/{rid}", headers=ALPHA).status_code == 204
        got += list(events)
    wait_for(lambda: running(sim) == 0, 5, "the cancelled request to leave the worker")
    tokens = seed_tokens(got)
    assert [t["index"] for t in tokens] == list(range(3, 3 + len(tokens)))
    assert got[-1].event == "error" and got[-1].data["error"]["code"] == "cancelled"


def test_a_log_trimmed_past_the_clients_position_is_a_410(sim: PrivateStack) -> None:
    done = read(sim.urls[0], "/generate_stream", "POST", {"prompt": "trimmed", "max_tokens": 20}, ALPHA)
    rid = done.headers["x-request-id"]
    client, log = sync_client(sim.redis_url), Keys(NAMESPACE).log(rid)
    count, header, *results = client.lrange(log, 0, -1)
    client.delete(log)
    client.rpush(log, count, header, *results[10:])  # what the bound in bytes leaves of a long stream
    client.expire(log, int(TTL))
    truncated = resume(sim.urls[1], rid, "8")
    assert truncated.status == 410 and json.loads(truncated.body)["error"]["code"] == "stream_truncated"
    tail = resume(sim.urls[1], rid, "9")
    assert [t["index"] for t in seed_tokens(tail.events)] == list(range(10, 20))


@pytest.mark.parametrize(("value", "choices", "positions"), [
    (None, 1, [-1]), ("", 2, [-1, -1]), ("12", 1, [12]), ("12.7.-1", 3, [12, 7, -1]), (" 4 ", 1, [4]),
    ("done", 2, None)])
def test_event_ids_give_each_choices_position(value: str | None, choices: int, positions: list[int] | None) -> None:
    assert parse_id(value, choices) == positions
    if positions is not None and value:
        assert format_id(positions) == value.strip()


@pytest.mark.parametrize(("value", "choices"), [("1.2", 1), ("3", 2), ("-2", 1), ("x", 1), ("1..2", 3),
                                                ("9" * 9000, 1)])
def test_an_event_id_of_another_stream_is_a_400(value: str, choices: int) -> None:
    with pytest.raises(ApiError) as refused:
        parse_id(value, choices)
    assert refused.value.status == 400 and refused.value.param == "Last-Event-ID"


def test_the_results_log_is_bounded_in_bytes() -> None:
    """The script every service publishes with keeps the header and the newest results within
    RESUME_LOG_BYTES, and appends only to the logs of streams a gateway created."""
    with redis_server() as redis_url:
        client, keys = redis.Redis.from_url(redis_url), Keys("bound")
        settings = Settings(resume_ttl=60.0, resume_log_bytes=400)
        client.rpush(keys.log("r1"), 0, b"header")
        for index in range(100):
            pipe = client.pipeline()
            publish_results(pipe, keys, settings, [(rid, encode(Token(index, "word"), 1 << 20), index)
                                                   for rid in ("r1", "r2")])
            pipe.execute()
        pipe = client.pipeline()
        publish_results(pipe, keys, settings, [("r1", encode(Done("length", 1, 100), 1 << 20), "")])
        pipe.execute()
        count, header, *results = client.lrange(keys.log("r1"), 0, -1)
        assert header == b"header" and int(count) == sum(map(len, results)) <= 400
        decoded = [decode(r, Token | Done, 1 << 20) for r in results]
        assert decoded[-1] == Done("length", 1, 100)
        indexes = [t.index for t in decoded[:-1]]
        assert indexes == list(range(indexes[0], 100)) and indexes[0] > 50
        assert 0 < client.pttl(keys.log("r1")) <= 60_000
        assert not client.exists(keys.log("r2"))  # nobody created it: nothing kept
        assert client.llen(keys.progress("r2")) == 100
        assert LOG_HEAD == 2


def test_a_gateway_killed_mid_stream_loses_its_clients_nothing() -> None:
    """kill -9 of the gateway holding two streams: one client reconnects to the other gateway and gets the
    rest; the other never comes back, and its request is cancelled once its lease lapses (nothing depends
    on the dead gateway)."""
    with sim_stack(1, gateways=2, **{**SETTINGS, "NAMESPACE": "killed"}) as stack:
        first, second = stack.urls
        port = first.rsplit(":", 1)[1]
        [gateway] = [process for index, (name, process) in enumerate(stack.stack.processes)
                     if name == "gateway" and stack.stack.overrides[index]["GATEWAY_PORT"] == port]
        body = {"prompt": "kill the gateway", "max_tokens": 400}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", f"{first}/generate_stream", json=body, headers=ALPHA) as kept, \
                client.stream("POST", f"{first}/generate_stream", json={**body, "max_tokens": 5000},
                              headers=ALPHA) as orphan:
            assert orphan.status_code == 200
            received = []
            for event in sse_events(kept):
                received.append(event)
                if len(received) == 20:
                    os.kill(gateway.pid, signal.SIGKILL)
                    break
            killed = time.monotonic()
            rid = kept.headers["x-request-id"]
        with httpx.Client(timeout=60) as client, client.stream(
                "GET", f"{second}/v1/requests/{rid}/stream", headers={**ALPHA, "Last-Event-ID": received[-1].id}
        ) as response:
            events = sse_events(response)
            rest = [next(events)]
            gap = time.monotonic() - killed
            # The orphan's lease lapses (nobody extends it any more) and a gateway cancels it: only ours runs.
            wait_for(lambda: running(stack) == 1, GRACE + 10, "the orphaned stream to be cancelled", interval=0.05)
            cancelled = time.monotonic() - killed
            rest += list(events)
        tokens = seed_tokens(received) + seed_tokens(rest)
        assert [t["index"] for t in tokens] == list(range(400))
        assert "".join(t["token"] for t in tokens) == sim_text(body["prompt"], 400)
        assert rest[-1].data["completion_tokens"] == 400
        print(f"kill -9 of the gateway: the next token came from the other {gap * 1000:.0f} ms after the kill; "
              f"the orphaned stream was cancelled {cancelled:.2f} s after it (RESUME_GRACE={GRACE})")
        assert cancelled >= GRACE - 0.5


def test_each_gateways_cluster_view_counts_the_tokens_of_all(sim: PrivateStack) -> None:
    """The cluster view's tokens/s is the cluster's: tokens delivered through one gateway show on the other."""
    def rate(url: str) -> float:
        return httpx.get(f"{url}/v1/cluster", headers=ALPHA, timeout=10).json()["tokens_per_s"]

    wait_for(lambda: rate(sim.urls[1]) == 0, 20, "a quiet cluster")  # the 10 s window of earlier tests
    done = read(sim.urls[0], "/generate_stream", "POST", {"prompt": "counted", "max_tokens": 200}, ALPHA)
    assert len(seed_tokens(done.events)) == 200
    wait_for(lambda: rate(sim.urls[1]) * 10 >= 200, 5, "the other gateway to count them")
    assert rate(sim.urls[0]) * 10 >= 200
    history = httpx.get(f"{sim.urls[1]}/v1/cluster", headers=ALPHA, timeout=10).json()["history"]
    assert len(history) == 60 and sum(tokens for _, tokens in history) * 5 >= 200


def test_llmserve_up_starts_gateways_on_consecutive_ports() -> None:
    port = free_ports(2)
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, **SETTINGS, "NAMESPACE": "up", "REDIS_URL": redis_url, "GATEWAY_PORT": str(port),
           "GATEWAY_HOST": "127.0.0.1", "SCHEDULER_METRICS_PORT": str(free_port()),
           "WORKER_METRICS_PORT": str(free_port()), "LAUNCHER_METRICS_PORT": str(free_port())}
    launcher = subprocess.Popen([str(Path(sys.executable).with_name("llmserve")), "up", "--workers", "1",
                                 "--gateways", "2"], env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    try:
        for url in urls:
            wait_for(lambda url=url: _serves(url), 60, f"a gateway at {url}")
        broken = read(urls[0], "/generate_stream", "POST", {"prompt": "two gateways", "max_tokens": 20}, ALPHA,
                      upto=5)
        rest = resume(urls[1], broken.headers["x-request-id"], broken.events[-1].id)
        assert [t["index"] for t in seed_tokens(broken.events) + seed_tokens(rest.events)] == list(range(20))
    finally:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) == 0


def _serves(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).json()["workers"] == 1
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def test_the_resumed_greedy_text_equals_an_unbroken_run(stack: RunningStack) -> None:
    """On the real model: a greedy stream broken after k tokens and resumed has the text of one never broken."""
    body = {"prompt": "The history of the printing press begins", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    unbroken = read(stack.url, "/generate_stream", "POST", body)
    expected = "".join(t["token"] for t in seed_tokens(unbroken.events))
    for k in (1, 17):
        broken = read(stack.url, "/generate_stream", "POST", body, upto=k)
        rest = resume(stack.url, broken.headers["x-request-id"], broken.events[-1].id, headers={})
        tokens = seed_tokens(broken.events) + seed_tokens(rest.events)
        assert [t["index"] for t in tokens] == list(range(40))
        assert "".join(t["token"] for t in tokens) == expected
        assert rest.events[-1].data["completion_tokens"] == 40
