"""Metrics of every service, the journey of a request_id, the cluster view, the status
command and the JSON logs, on the real stack."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.telemetry import JsonFormatter
from gateway.throughput import Throughput
from tests.conftest import RunningStack, dispatched_to, wait_for
from tests.sse import stream
from tests.test_stack import heartbeats

JOURNEY = ["received", "queued", "dispatched", "admitted", "prefill_done", "first_token", "finished", "delivered"]


def scrape(url: str, **labels: str) -> dict[str, float]:
    """Every sample of a Prometheus endpoint (those with these `labels`), summed over labels, by sample name."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if labels.items() <= sample.labels.items():
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def test_every_service_exposes_its_metrics(stack: RunningStack) -> None:
    """What one request adds to each service's metrics, counted from an idle stack: the totals of the session's
    earlier tests alone would meet any threshold."""
    ports = {beat.worker_id: beat.metrics_port for beat in heartbeats(stack)}
    assert len(set(ports.values())) == 2 and all(ports.values())
    urls = {"gateway": f"{stack.url}/metrics",
            "scheduler": f"http://127.0.0.1:{stack.stack.env['SCHEDULER_METRICS_PORT']}/metrics",
            **{worker_id: f"http://127.0.0.1:{port}/metrics" for worker_id, port in ports.items()}}
    wait_for(lambda: all(not b.running and not b.waiting for b in heartbeats(stack)), 60, "an idle stack")
    before = {service: scrape(url) for service, url in urls.items()}
    # Each scrape is an HTTP request too: the stream's route alone.
    streams_before = scrape(urls["gateway"], route="/generate_stream").get("llmserve_gateway_requests_total", 0.0)
    with stack.client() as client:
        request_id, _ = stream(client, {"prompt": "Paris is", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    [worker_id] = dispatched_to(stack.url, request_id)

    def added(service: str, name: str) -> float:
        return scrape(urls[service])[name] - before[service].get(name, 0.0)

    # The gateway counts a stream's last figures as it ends, which its client may see first.
    wait_for(lambda: added("gateway", "llmserve_gateway_completion_tokens_total") == 6, 5,
             "the gateway to count the stream's tokens")
    assert scrape(urls["gateway"], route="/generate_stream")["llmserve_gateway_requests_total"] == streams_before + 1
    assert added("gateway", "llmserve_gateway_time_to_first_token_seconds_count") == 1
    assert added("gateway", "llmserve_gateway_inter_token_latency_seconds_count") == 5
    gateway = scrape(urls["gateway"])
    for name in ("e2e_latency_seconds_count", "queue_seconds_count", "prompt_tokens_total", "active_requests"):
        assert f"llmserve_gateway_{name}" in gateway
    assert added("scheduler", "llmserve_scheduler_dispatched_total") == 1
    scheduler = scrape(urls["scheduler"])
    assert scheduler["llmserve_scheduler_live_workers"] == 2
    for name in ("waiting", "dispatch_latency_seconds_count", "migrations_total", "free_slots"):
        assert f"llmserve_scheduler_{name}" in scheduler
    assert added(worker_id, "llmserve_worker_generated_tokens_total") == 6
    assert added(worker_id, "llmserve_worker_step_seconds_count") >= 6
    assert added(worker_id, "llmserve_worker_batch_size_count") >= 5
    for other in set(ports) - {worker_id}:
        assert added(other, "llmserve_worker_generated_tokens_total") == 0
    for name in ("running", "waiting", "kv_cache_positions"):
        assert all(f"llmserve_worker_{name}" in scrape(urls[w]) for w in ports)


def test_the_trace_follows_a_request_across_every_hop(stack: RunningStack) -> None:
    with stack.client() as client:
        request_id, _ = stream(client, {"prompt": "The quick brown", "max_tokens": 5, "temperature": 0})
        # The gateway records "delivered" once the stream's last event is written, which the client may read first.
        deadline = time.monotonic() + 5
        while True:
            trace = client.get(f"/v1/requests/{request_id}/trace").json()
            hops = [event["hop"] for event in trace["events"]]
            if hops[-1:] == JOURNEY[-1:] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert hops == JOURNEY
    services = {event["hop"]: event["service"] for event in trace["events"]}
    assert services["received"] == "gateway" and services["dispatched"] == "scheduler"
    assert services["first_token"] == "worker"
    assert all(event["since_previous_ms"] >= 0 for event in trace["events"])
    finished = trace["events"][hops.index("finished")]["detail"]
    assert finished["tokens"] == 5 and finished["reason"] == "length"
    dispatched = trace["events"][hops.index("dispatched")]["detail"]
    assert dispatched["worker_id"] in {beat.worker_id for beat in heartbeats(stack)}


def test_an_unknown_trace_is_a_404(stack: RunningStack) -> None:
    response = httpx.get(f"{stack.url}/v1/requests/nope/trace")
    assert response.status_code == 404 and response.json()["error"]["code"] == "trace_not_found"


def test_cluster_view_and_status_command(stack: RunningStack) -> None:
    cluster = httpx.get(f"{stack.url}/v1/cluster").json()
    assert len(cluster["workers"]) == 2 and all(w["slots"] == 16 for w in cluster["workers"])
    assert cluster["queue"] == 0 and len(cluster["history"]) == 60
    shown = subprocess.run([sys.executable, "-m", "llmserve.cli", "status", "--url", stack.url],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert all(w["id"] in shown.stdout for w in cluster["workers"]) and "queue: 0" in shown.stdout


def test_log_lines_are_json_with_the_request_id() -> None:
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter("gateway"))
    logger = logging.getLogger("json-test")
    logger.addHandler(handler)
    logger.warning("received", extra={"request_id": "r-1"})
    line = json.loads(buffer.getvalue())
    assert line["request_id"] == "r-1" and line["service"] == "gateway" and line["msg"] == "received"


def test_throughput_rates_and_history_from_per_second_counts() -> None:
    now = int(time.time())
    counts = Throughput({now - 2: 30, now - 1: 50, now - 400: 1000})  # the last is outside any window
    assert counts.rate(10, now) == 8.0 and counts.rate(1, now - 1) == 50.0
    history = counts.history()
    assert len(history) == 60 and history[-1][0] - now in (0, 1) and sum(rate for _, rate in history) * 5 == 80
