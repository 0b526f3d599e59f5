"""The worker's Prometheus metrics, served on WORKER_METRICS_PORT (or the next free port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RUNNING = Gauge("llmserve_worker_running", "Sequences in the running batch")
WAITING = Gauge("llmserve_worker_waiting", "Sequences admitted but not yet prefilled")
BATCH_SIZE = Histogram("llmserve_worker_batch_size", "Sequences per decode step",
                       buckets=(1, 2, 4, 8, 12, 16, 24, 32, 64, 128))
STEP_SECONDS = Histogram("llmserve_worker_step_seconds", "Duration of one engine step", ["kind"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
TOKENS = Counter("llmserve_worker_generated_tokens_total", "Tokens generated (rate() gives tokens/s)")
KV_CACHE_TOKENS = Gauge("llmserve_worker_kv_cache_positions", "Positions held in the KV cache (rows x width)")
MOVED_AWAY = Counter("llmserve_worker_moved_away_total",
                     "Requests dropped here because the scheduler moved them to other workers while this one stood "
                     "still past WORKER_TTL (frozen, paused)")
UNHELD = Counter("llmserve_worker_unheld_total",
                 "Assignments to this worker it found it did not hold (their Batch or their ending lost in a Redis "
                 "failover), reported to the scheduler to move on")
HEARTBEAT_ERRORS = Counter("llmserve_worker_heartbeat_errors_total",
                           "Heartbeats not sent: Redis unreachable (redis) or a fault of the worker's own (internal)",
                           ["kind"])
FINISHED = Counter("llmserve_worker_finished_total", "Sequences that left the worker", ["reason"])
PREFIX_QUERIED = Counter("llmserve_worker_prefix_cache_queried_tokens_total",
                         "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter("llmserve_worker_prefix_cache_hit_tokens_total",
                      "Prompt tokens whose keys and values came from the prefix cache instead of a forward")
PREFIX_BYTES = Gauge("llmserve_worker_prefix_cache_bytes", "Bytes of keys and values the prefix cache holds")
# vLLM's names for the same two counts, labelled by model (the rest of vLLM's are in worker/compat_metrics.py).
VLLM_PREFIX_QUERIES = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's "
                              "name)", ["model_name"])
VLLM_PREFIX_HITS = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (vLLM's name)",
                           ["model_name"])


def prefix_lookup(model: str, queried: int, hits: int) -> None:
    """A prompt looked up in the prefix cache: its tokens, and how many of them were found."""
    PREFIX_QUERIED.inc(queried)
    PREFIX_HITS.inc(hits)
    VLLM_PREFIX_QUERIES.labels(model).inc(queried)
    VLLM_PREFIX_HITS.labels(model).inc(hits)
