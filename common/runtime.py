"""What every service's I/O loop does the same way: its id, backoff after a Redis failure,
decoding a bus message or dropping it with a log line, reading the live workers' heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis
from redis.exceptions import ClusterError, RedisClusterException, SlotNotCoveredError, TryAgainError

from common.protocol import Heartbeat, ProtocolError, decode

T = TypeVar("T")


def service_id() -> str:
    """host-pid-random: unique per process, and the pid in it tells an operator what to kill."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class Backoff:
    """Exponential delays between retries: `first`, doubling up to `cap`; `reset()` after a success."""

    first: float = 0.1
    cap: float = 5.0
    current: float = 0.0

    def next(self) -> float:
        self.current = min(self.current * 2, self.cap) if self.current else self.first
        return self.current

    def reset(self) -> None:
        self.current = 0.0


def decode_or_drop(data: bytes | None, kind: type[T], limit: int, log: logging.Logger, what: str,
                   **context: object) -> T | None:
    """`data` decoded as `kind`, or None with an error logged: a malformed message is dropped, never raised
    into a service loop."""
    if data is None:
        log.error(f"dropped {what}: no payload", extra=context)
        return None
    try:
        return decode(data, kind, limit)
    except ProtocolError as exc:
        log.error(f"dropped {what}", extra={**context, "error": str(exc)})
        return None


def parse_heartbeats(ids: Sequence[str], raws: Sequence[bytes | None], limit: int,
                     log: logging.Logger) -> dict[str, Heartbeat | None]:
    """worker id -> its heartbeat, or None where it has lapsed or cannot be read (the worker counts as gone)."""
    beats: dict[str, Heartbeat | None] = {}
    for worker_id, raw in zip(ids, raws, strict=True):
        beats[worker_id] = None if raw is None else decode_or_drop(raw, Heartbeat, limit, log, "a heartbeat",
                                                                    worker_id=worker_id)
    return beats


# What a Redis client raises: redis-py's cluster client raises RedisClusterException, which is no RedisError,
# when no node answers or a slot has no node (and for misuse, which is a bug).
REDIS_ERRORS = (redis.RedisError, RedisClusterException)
# redis-py's words for a cluster it cannot reach, or whose slot map it cannot complete.
_CLUSTER_AWAY = ("Redis Cluster cannot be connected", "All slots are not covered", "startup_nodes could not agree",
                 "No targets were found")


# Replies of a server that is restarting empty, loading, full under noeviction, a replica now, or a primary that no
# replica follows (min-replicas-to-write).
_WAITED_OUT = ("NOGROUP", "OOM", "LOADING", "READONLY", "NOREPLICAS")


def redis_trouble(exc: BaseException) -> bool:
    """Whether `exc` says Redis is away, restarted empty (NOGROUP), loading, full (OOM under noeviction), or
    short of replicas to write (NOREPLICAS), or a cluster is down, failing over or moving slots: conditions a
    service waits out with backoff. Any other error is a bug to surface."""
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | SlotNotCoveredError | ClusterError
                  | TryAgainError):
        return True
    if isinstance(exc, RedisClusterException):
        return str(exc).startswith(_CLUSTER_AWAY)
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(_WAITED_OUT)


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a service's background loop and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
