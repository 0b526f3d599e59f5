"""The worker's metrics under vLLM's names, labelled by model, next to its own (worker/metrics.py): so
that dashboards and autoscalers written for vLLM read this stack unchanged. The gateway exports the
latency histograms and token counters; the scheduler its queue's share of num_requests_waiting. The
prefix-cache counters live in worker/metrics.py beside llmserve's own, since the engine counts them (and
this module shares names with the scheduler's, which a process importing both may not register twice)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from worker.core import Engine

RUNNING = Gauge("vllm:num_requests_running", "Sequences in the running batch (vLLM's name)", ["model_name"])
WAITING = Gauge("vllm:num_requests_waiting", "Requests waiting: admitted to a worker and not yet prefilled, or "
                "in the scheduler's queue (vLLM's name)", ["model_name"])
KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "Share of the KV cache's positions in use, 0 to 1 (vLLM's name)",
                 ["model_name"])
SUCCESS = Counter("vllm:request_success", "Requests that left a worker, by why (vLLM's name)",
                  ["model_name", "finished_reason"])

# How a request leaves the worker (the hop of its trace), in vLLM's words when it did not finish.
_REASONS = {"cancelled": "abort", "failed": "error"}


def observe_step(model: str, engine: Engine, slots: int, context: int) -> None:
    """After each engine step: the batch, the waiting line and the cache, whose capacity is a full
    context for every slot."""
    RUNNING.labels(model).set(engine.running_count)
    WAITING.labels(model).set(engine.waiting_count)
    capacity = slots * context
    KV_USAGE.labels(model).set(min(engine.cache_positions / capacity, 1.0) if capacity > 0 else 0.0)


def released(model: str, hop: str, reason: object = None) -> None:
    """A request left the worker: finished (with its finish reason), cancelled or failed."""
    SUCCESS.labels(model, str(reason) if hop == "finished" and reason else _REASONS.get(hop, hop)).inc()
