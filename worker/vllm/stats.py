"""vLLM's engine statistics into the worker's metrics. vLLM's own Prometheus logger would register its whole set in
this process (unregistering the worker's `vllm:` gauges first) and count again what the gateway already exports
under vLLM's names (the latency histograms, the token counters), so that dashboards summing every service would
see those twice. This logger stands in for it: it keeps the latest scheduler statistics for the engine
(worker/vllm/engine.py reads the KV cache's use from them) and counts the prefix cache's lookups, as the own engine
does. Imported only where vLLM is."""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import PrometheusStatLogger

from worker import metrics


class EngineStats(PrometheusStatLogger):
    """Registered as vLLM's Prometheus logger (so vLLM adds no other); one vLLM engine per worker process."""

    latest: Any = None  # vLLM's SchedulerStats after the last step
    model = ""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        # vLLM's Prometheus metrics are not made: see the module's docstring.
        self.engine_indexes = engine_indexes or [0]

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        EngineStats.latest = scheduler_stats
        prefix = scheduler_stats.prefix_cache_stats
        if prefix is not None and prefix.queries:
            metrics.prefix_lookup(self.model, prefix.queries, prefix.hits)

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass
