"""Fixtures that run the real parts: a private redis-server, the services as
separate processes, the real default model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from common.clients import sync_client
from common.protocol import Keys
from llmserve.launcher import Stack, free_port, private_stack
from llmserve.launcher import wait_until as wait_for


@dataclass
class RunningStack:
    url: str
    redis: redis.Redis
    keys: Keys
    stack: Stack

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def extra(self, services: list[str], **settings: str) -> tuple[str, Stack]:
        """More services of this stack's Redis with other settings (no model load unless a worker);
        returns the URL of their gateway and the Stack to stop."""
        port = free_port()
        extra = Stack({**self.stack.env, "GATEWAY_PORT": str(port), **settings})
        for name in services:
            extra.spawn(name)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: responds(f"{url}/health"), 30, "the extra gateway")
        return url, extra


def responds(url: str) -> bool:
    try:
        return httpx.get(url).status_code < 500
    except httpx.HTTPError:
        return False


STACK_WORKERS = 2


@pytest.fixture(scope="session")
def stack() -> Iterator[RunningStack]:
    """Gateway, scheduler and two workers, each its own process, on the real model."""
    settings = {"NAMESPACE": "test", "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
                "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port())}
    with private_stack(STACK_WORKERS, **settings) as running:
        yield RunningStack(running.url, sync_client(running.redis_url), Keys("test"), running.stack)
