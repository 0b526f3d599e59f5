"""The gateway's Prometheus metrics and its recent-throughput window for the cluster view."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter("llmserve_gateway_requests_total", "HTTP requests by route and status", ["route", "status"])
TTFT = Histogram("llmserve_gateway_time_to_first_token_seconds", "From admission to the first token",
                 buckets=LATENCY_BUCKETS)
ITL = Histogram("llmserve_gateway_inter_token_latency_seconds", "Between two tokens of one completion",
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
E2E = Histogram("llmserve_gateway_e2e_latency_seconds", "From admission to the last result", buckets=LATENCY_BUCKETS)
QUEUE = Histogram("llmserve_gateway_queue_seconds", "From admission to a worker taking the request",
                  buckets=LATENCY_BUCKETS)
TOKENS_IN = Counter("llmserve_gateway_prompt_tokens_total", "Prompt tokens of finished requests")
TOKENS_OUT = Counter("llmserve_gateway_completion_tokens_total", "Tokens delivered to clients")
ACTIVE = Gauge("llmserve_gateway_active_requests", "Requests admitted and not yet ended")
SLOW_CLIENTS = Counter("llmserve_gateway_slow_clients_total",
                       "HTTP requests cancelled because their client stopped reading past CLIENT_BUFFER_BYTES")

# Paths with an id in them are counted under their template, to keep the label set small.
_TEMPLATES = (("/v1/requests/", "/v1/requests/{request_id}/trace"), ("/static/", "/static"))


def route_label(path: str) -> str:
    for prefix, template in _TEMPLATES:
        if path.startswith(prefix):
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


class Throughput:
    """Output tokens per second over the last minutes, in one-second buckets."""

    def __init__(self, horizon_s: int = 300) -> None:
        self.buckets: deque[list[int]] = deque(maxlen=horizon_s)

    def add(self, tokens: int) -> None:
        second = int(time.time())
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += tokens
        else:
            self.buckets.append([second, tokens])

    def rate(self, window_s: int = 10, until: int | None = None) -> float:
        end = int(time.time()) if until is None else until
        return sum(n for second, n in self.buckets if end - window_s < second <= end) / window_s

    def history(self, step_s: int = 5, horizon_s: int = 300) -> list[list[float]]:
        end = int(time.time())
        return [[t, self.rate(step_s, t)] for t in range(end - horizon_s + step_s, end + 1, step_s)]
