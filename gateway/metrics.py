"""The gateway's Prometheus metrics."""

from __future__ import annotations

import functools
from contextvars import ContextVar

from prometheus_client import Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.settings import ModelSettings

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# The model the current HTTP request names (set by the OpenAI routes); else the configured one.
MODEL_NAME: ContextVar[str] = ContextVar("model_name", default="")


@functools.cache
def _configured_model() -> str:
    return ModelSettings.from_env().model


def model_name() -> str:
    return MODEL_NAME.get() or _configured_model()


class Twin:
    """One of our metrics fed together with its vLLM-named twin, labelled by model, so that dashboards and
    autoscalers written for vLLM read this stack unchanged."""

    def __init__(self, ours: Histogram | Counter, theirs: Histogram | Counter) -> None:
        self.ours, self.theirs = ours, theirs

    def observe(self, value: float) -> None:
        self.ours.observe(value)
        self.theirs.labels(model_name()).observe(value)

    def inc(self, amount: float = 1) -> None:
        self.ours.inc(amount)
        self.theirs.labels(model_name()).inc(amount)


def _vllm_histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(f"vllm:{name}", f"{doc} (vLLM's name)", ["model_name"], buckets=buckets)


REQUESTS = Counter("llmserve_gateway_requests_total", "HTTP requests by route and status", ["route", "status"])
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TTFT = Twin(Histogram("llmserve_gateway_time_to_first_token_seconds", "From admission to the first token",
                      buckets=LATENCY_BUCKETS),
            _vllm_histogram("time_to_first_token_seconds", "From admission to the first token", LATENCY_BUCKETS))
ITL = Twin(Histogram("llmserve_gateway_inter_token_latency_seconds", "Between two tokens of one completion",
                     buckets=ITL_BUCKETS),
           _vllm_histogram("inter_token_latency_seconds", "Between two tokens of one completion", ITL_BUCKETS))
E2E = Twin(Histogram("llmserve_gateway_e2e_latency_seconds", "From admission to the last result",
                     buckets=LATENCY_BUCKETS),
           _vllm_histogram("e2e_request_latency_seconds", "From admission to the last result", LATENCY_BUCKETS))
QUEUE = Twin(Histogram("llmserve_gateway_queue_seconds", "From admission to a worker taking the request",
                       buckets=LATENCY_BUCKETS),
             _vllm_histogram("request_queue_time_seconds", "From admission to a worker taking the request",
                             LATENCY_BUCKETS))
TOKENS_IN = Twin(Counter("llmserve_gateway_prompt_tokens_total", "Prompt tokens of finished requests"),
                 Counter("vllm:prompt_tokens", "Prompt tokens of finished requests (vLLM's name)", ["model_name"]))
TOKENS_OUT = Twin(Counter("llmserve_gateway_completion_tokens_total", "Tokens delivered to clients"),
                  Counter("vllm:generation_tokens", "Tokens delivered to clients (vLLM's name)", ["model_name"]))
ACTIVE = Gauge("llmserve_gateway_active_requests", "Requests admitted and not yet ended")
SLOW_CLIENTS = Counter("llmserve_gateway_slow_clients_total",
                       "HTTP requests cancelled because their client stopped reading past CLIENT_BUFFER_BYTES")
DETACHED = Counter("llmserve_gateway_detached_streams_total",
                   "Streams whose client left, left running for RESUME_GRACE in case it comes back")
QUOTA_REFUSED = Counter("llmserve_gateway_quota_refused_total",
                        "Requests refused by an API key's requests or tokens per minute", ["kind"])
BATCH_LINES = Counter("llmserve_gateway_batch_lines_total",
                      "Lines of batch jobs answered by this gateway, by file: completed (output) or failed (errors)",
                      ["outcome"])
BATCH_LINES_LEFT = Gauge("llmserve_gateway_batch_lines_left",
                         "Lines not yet answered of the batch jobs this gateway runs (each job runs on one gateway: "
                         "the sum over gateways is every running job's)")
BATCH_JOBS = Gauge("llmserve_gateway_batch_jobs_running", "Batch jobs this gateway runs (holds the lease of)")
# Every label value exists from the start, at 0, so that a dashboard's rate() reads 0, not "no data".
for _kind in ("rpm", "tpm"):
    QUOTA_REFUSED.labels(_kind)
for _outcome in ("completed", "failed"):
    BATCH_LINES.labels(_outcome)
RESUMED = Counter("llmserve_gateway_resumed_streams_total", "Streams resumed here (GET /v1/requests/{id}/stream)")
ABANDONED = Counter("llmserve_gateway_abandoned_streams_total",
                    "Streams cancelled here because nobody resumed them within RESUME_GRACE (or their gateway died)")

# Paths with an id in them are counted under their template, to keep the label set small.
_TEMPLATES = (("/v1/requests/", "/trace", "/v1/requests/{request_id}/trace"),
              ("/v1/requests/", "/stream", "/v1/requests/{request_id}/stream"),
              ("/v1/requests/", "", "/v1/requests/{request_id}"), ("/static/", "", "/static"))


def route_label(path: str) -> str:
    for prefix, suffix, template in _TEMPLATES:
        if path.startswith(prefix) and path.endswith(suffix):
            return template
    return path


class CountRequests:
    """Counts every HTTP response by route and status (streams count when their headers go out)."""

    def __init__(self, app: ASGIApp, routes: set[str]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_label(scope["path"])
        route = route if route in self.routes else "other"

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                REQUESTS.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted_send)
