"""The scheduler queue's share of vLLM's `vllm:num_requests_waiting` (the workers export theirs): read from
the scheduler's own waiting gauge at each scrape, so that the scheduler's loop needs no change."""

from __future__ import annotations

import functools
from collections.abc import Iterator

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.settings import Settings
from scheduler import metrics


@functools.cache
def _model() -> str:
    return Settings.from_env().model


class QueueCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in the scheduler's queue "
                                   "(vLLM's name)", labels=["model_name"])
        family.add_metric([_model()], metrics.WAITING._value.get())
        yield family


# Registered once, by scheduler/metrics.py importing this module.
REGISTRY.register(QueueCollector())
