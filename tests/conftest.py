"""Fixtures that run the real parts: a private redis-server, the services as
separate processes, the real default model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from common.protocol import Keys
from llmserve.launcher import Stack, free_port, start_redis
from llmserve.launcher import wait_until as wait_for


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private redis-server on a free port (never the machine's own on 6379)."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    server = start_redis(url)
    yield url
    server.terminate()
    server.wait()


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
        wait_for(lambda: _answers(f"{url}/health"), 30, "the extra gateway")
        return url, extra


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code < 500
    except httpx.HTTPError:
        return False


STACK_WORKERS = 2


@pytest.fixture(scope="session")
def stack(redis_url: str) -> Iterator[RunningStack]:
    """Gateway, scheduler and two workers, each its own process, on the real model."""
    port = free_port()
    env = dict(os.environ, REDIS_URL=redis_url, NAMESPACE="test", GATEWAY_PORT=str(port),
               GATEWAY_HOST="127.0.0.1", WORKER_THREADS="1", HEARTBEAT_INTERVAL="0.3", WORKER_TTL="2",
               LOG_LEVEL="INFO")
    running = Stack(env)
    running.start(STACK_WORKERS)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert not running.exited(), f"{running.exited()} exited during start-up"
        try:
            return httpx.get(f"{url}/health").json()["workers"] == STACK_WORKERS
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 180, "the stack's workers")
        yield RunningStack(url, redis.Redis.from_url(redis_url), Keys("test"), running)
    finally:
        running.stop()
