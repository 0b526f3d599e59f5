"""Each model's share of vLLM's `vllm:num_requests_waiting` (the workers export theirs): the scheduler's queue,
by the model its requests name, with what that model's workers run and how many there are, as the leading
scheduler last counted them (scheduler/policy.py's model_figures). Read at each scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.protocol import ModelLoad

_loads: dict[str, ModelLoad] = {}


def set_models(loads: dict[str, ModelLoad]) -> None:
    global _loads
    _loads = dict(loads)


class ModelCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = [
            (GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in the scheduler's queue (vLLM's name)",
                               labels=["model_name"]), "waiting"),
            (GaugeMetricFamily("llmserve_scheduler_running", "Requests the model's workers run",
                               labels=["model_name"]), "running"),
            (GaugeMetricFamily("llmserve_scheduler_model_workers", "Live workers that answer to the model",
                               labels=["model_name"]), "workers"),
        ]
        for family, field in families:
            for model, load in _loads.items():
                family.add_metric([model], getattr(load, field))
            yield family


REGISTRY.register(ModelCollector())
