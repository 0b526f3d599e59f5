"""Fixtures that run the real parts: a private redis-server, the services as
separate processes, the real default model."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from common.protocol import Keys
from llmserve.launcher import Stack


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                               "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    wait_for(lambda: _pings(url), 10, "redis-server")
    yield url
    server.terminate()
    server.wait()


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url).ping())
    except redis.ConnectionError:
        return False


@dataclass
class RunningStack:
    url: str
    redis: redis.Redis
    keys: Keys
    stack: Stack

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)


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
