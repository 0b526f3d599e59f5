"""Private stacks for tests and benchmarks: the launcher's Stack on a redis-server of its own (or a private
cluster or Sentinel group, harness/topology.py), on free ports, and what tests and benchmarks read of one: a
service's pid from its id, the live workers, the keys without a TTL. Not part of the installed package."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from common.keys import Keys
from harness.topology import start_cluster, start_sentinel
from llmserve.launcher import Stack, gateway_ports, serving, start_redis, total
from llmserve.processes import free_port, free_ports, wait_until


def pid_of(service_id: str | bytes) -> int:
    """The process of a worker, scheduler or gateway, from its id (host-pid-suffix: common/runtime.py) as a
    string or as Redis gives it."""
    text = service_id.decode() if isinstance(service_id, bytes) else service_id
    return int(text.split("-")[-2])


def live_workers(r: Any, keys: Keys) -> set[str]:
    """The ids of the workers of `keys`' namespace whose heartbeat has not expired."""
    ids = [member.decode() for member in r.smembers(keys.workers)]
    return {i for i, beat in zip(ids, r.mget([keys.heartbeat(i) for i in ids]) if ids else [], strict=True) if beat}


def lasting(r: Any) -> set[str]:
    """The keys with no expiry."""
    return {key.decode() for key in r.scan_iter(count=1000) if r.ttl(key) == -1}


@dataclass
class PrivateStack:
    """A stack with a Redis of its own, for tests and benchmarks."""

    url: str
    stack: Stack
    redis_url: str
    redis_process: subprocess.Popen[bytes] | None
    # Every gateway's URL, `url` first.
    urls: list[str] = field(default_factory=list)
    # A cluster or a Sentinel group (harness/topology.py) in place of the one redis-server.
    topology: Any = None

    def stop_redis(self) -> None:
        if self.topology is not None:
            self.topology.stop()
            return
        self.redis_process.terminate()
        self.redis_process.wait()

    def start_redis(self) -> None:
        self.redis_process = start_redis(self.redis_url)


@contextmanager
def private_stack(workers: int | dict[str, int], gateways: int = 1, redis: str = "single",
                  commands: dict[str, list[str]] | None = None,
                  **settings: str) -> Iterator[PrivateStack]:
    """Its own redis-server on a free port (`redis="cluster"`: a cluster of three masters;
    `"cluster-with-replicas"`: each with a replica; `"sentinel"`: a primary, a replica and a Sentinel) and
    every service (`gateways` of them on consecutive ports), with `settings` on top of the environment and
    `commands` in place of a service's own; yields once all workers serve."""
    topology = None
    if redis == "single":
        redis_url = f"redis://127.0.0.1:{free_port()}/0"
        process = start_redis(redis_url)
    else:
        topology = start_sentinel() if redis == "sentinel" else start_cluster(replicas=int(redis.endswith("replicas")))
        redis_url, process = topology.url, None
    port = free_ports(gateways)
    stack = Stack({**os.environ, "REDIS_URL": redis_url, "GATEWAY_HOST": "127.0.0.1", "GATEWAY_PORT": str(port),
                   **settings}, commands=commands or {})
    urls = [f"http://127.0.0.1:{p}" for p in gateway_ports(stack.env, gateways)]
    running = PrivateStack(urls[0], stack, redis_url, process, urls, topology)
    try:
        stack.start(workers, gateways)
        for url in urls:
            wait_until(lambda url=url: serving(url, total(workers), stack), 300,
                       f"{total(workers)} worker(s) behind {url}", interval=0.5)
        yield running
    finally:
        stack.stop()
        running.stop_redis()
