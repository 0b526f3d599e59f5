"""One way for every service to reach Redis from REDIS_URL:

- `redis://`, `rediss://`, `unix://`: one server (the default), exactly as redis-py reads such URLs;
- `redis+cluster://[user:password@]host:port[,host:port...]`: a Redis Cluster, through any of its nodes;
- `redis+sentinel://[user:password@]host:port[,host:port...]/service-name[/db]`: the primary that Sentinel
  names for `service-name` (credentials are the data servers'; the sentinels are asked without).

`parse_redis_url` checks a URL at start (a SettingsError naming REDIS_URL); `sync_client` and `async_client`
return the redis-py client of each kind. A cluster client is built on first use, so that a service started
before its cluster is reachable waits it out like any Redis outage instead of failing to start."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.cluster import ClusterNode, ClusterPipeline
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.maint_notifications import MaintNotificationsConfig
from redis.sentinel import Sentinel, SentinelManagedConnection

from common.errors import SettingsError

CLUSTER_SCHEME = "redis+cluster://"
SENTINEL_SCHEME = "redis+sentinel://"
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
# Connections one asyncio cluster client may open to each node (the gateway's pool is 64 to one server; a
# cluster spreads the same load over its nodes, and redis-py refuses rather than waits past the bound).
CLUSTER_NODE_CONNECTIONS = 256
# Seconds a sentinel may take to answer which server is the primary before the next one is asked.
SENTINEL_TIMEOUT = 2.0

# Cluster clients skip redis-py's maintenance-notification handshake (a managed-service feature): one round
# trip less per connection, and its handshake on a connection to a node that just died raised RuntimeError
# (a closed transport) rather than a connection error.
NO_MAINTENANCE = MaintNotificationsConfig(enabled=False)

Mode = Literal["single", "cluster", "sentinel"]


@dataclass(frozen=True)
class RedisTarget:
    """What REDIS_URL names."""

    mode: Mode
    url: str
    nodes: tuple[tuple[str, int], ...] = ()  # cluster nodes, or sentinels
    service: str = ""  # Sentinel's name of the primary
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def cluster(self) -> bool:
        return self.mode == "cluster"

    def credentials(self) -> dict[str, str]:
        return {name: value for name, value in (("username", self.username), ("password", self.password)) if value}


def _bad(url: str, why: str) -> SettingsError:
    return SettingsError(f"REDIS_URL={url!r}: {why}")


@lru_cache(maxsize=32)
def parse_redis_url(url: str) -> RedisTarget:
    """The target of `url`, or SettingsError naming REDIS_URL."""
    if url.startswith(CLUSTER_SCHEME):
        return _parse_multi(url, "cluster", url[len(CLUSTER_SCHEME):])
    if url.startswith(SENTINEL_SCHEME):
        return _parse_multi(url, "sentinel", url[len(SENTINEL_SCHEME):])
    try:
        params = parse_url(url)
    except ValueError as exc:
        raise _bad(url, f"{exc} (expected redis://, rediss://, unix://, redis+cluster://host:port[,host:port] "
                        "or redis+sentinel://host:port[,host:port]/service-name[/db])") from None
    return RedisTarget("single", url, db=int(params.get("db", 0)), username=params.get("username"),
                       password=params.get("password"))


def _parse_multi(url: str, mode: Mode, rest: str) -> RedisTarget:
    """`[user:password@]host:port[,host:port...][/path]` after the scheme."""
    netloc, _, path = rest.partition("/")
    if "?" in netloc or "?" in path:
        raise _bad(url, "takes no query parameters")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    default_port = DEFAULT_SENTINEL_PORT if mode == "sentinel" else DEFAULT_PORT
    nodes = tuple(_host_port(url, part, default_port) for part in hosts.split(","))
    parts = [unquote(p) for p in path.split("/") if p]
    service, db = "", 0
    if mode == "sentinel":
        if not parts:
            raise _bad(url, "names no service: redis+sentinel://host:port/service-name[/db]")
        service, db = parts[0], _db(url, parts[1:])
    elif parts and parts != ["0"]:
        raise _bad(url, "a cluster has database 0 only: redis+cluster://host:port[,host:port]")
    return RedisTarget(mode, url, nodes, service, db, unquote(username) or None, unquote(password) or None)


def _host_port(url: str, part: str, default_port: int) -> tuple[str, int]:
    if part.startswith("["):  # an IPv6 address: [::1]:7000
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise _bad(url, f"{part!r} names no host")
    try:
        number = int(port) if port else default_port
    except ValueError:
        raise _bad(url, f"{part!r}: the port is not a number") from None
    if not 0 < number < 65536:
        raise _bad(url, f"{part!r}: the port is out of range")
    return host, number


def _db(url: str, parts: list[str]) -> int:
    if not parts:
        return 0
    if len(parts) > 1 or not parts[0].isdigit():
        raise _bad(url, "the database after the service name must be a number")
    return int(parts[0])


def is_cluster(url: str) -> bool:
    return parse_redis_url(url).cluster


# Under Sentinel, a primary run with `min-replicas-to-write` refuses writes once no replica follows it: in a
# failover that is the old primary, which goes on answering until Sentinel demotes it. redis-py drops the
# connection on READONLY (a primary already demoted) but not on NOREPLICAS, so each of its writes would fail there
# for the seconds until the demotion; dropping the connection makes the next command ask Sentinel again.

def _not_replicated(connection: Any, exc: ResponseError) -> bool:
    return connection.connection_pool.is_master and str(exc).startswith("NOREPLICAS")


def _refused(exc: ResponseError) -> RedisConnectionError:
    return RedisConnectionError(f"the primary refused a write for want of replicas ({exc}); asking Sentinel again")


class _PrimaryConnection(SentinelManagedConnection):
    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not _not_replicated(self, exc):
                raise
            self.disconnect()
            raise _refused(exc) from exc


class _AsyncPrimaryConnection(AsyncSentinelConnection):
    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not _not_replicated(self, exc):
                raise
            await self.disconnect()
            raise _refused(exc) from exc


# Sync clients: the scheduler, the workers, the launcher and tests.

def sync_client(url: str, **options: Any) -> Any:
    """A redis-py client of what `url` names: redis.Redis (one server, or Sentinel's primary), or a cluster
    client built on first use."""
    target = parse_redis_url(url)
    if target.mode == "single":
        return redis.Redis.from_url(url, **options)
    if target.mode == "sentinel":
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs={"socket_timeout": SENTINEL_TIMEOUT})
        return sentinel.master_for(target.service, db=target.db, connection_class=_PrimaryConnection,
                                   **target.credentials(), **options)
    nodes = [ClusterNode(host, port) for host, port in target.nodes]
    return LazyCluster(lambda: redis.RedisCluster(startup_nodes=nodes, maint_notifications_config=NO_MAINTENANCE,
                                                  **target.credentials(), **options))


class LazyCluster:
    """A redis.RedisCluster built at its first use: its constructor needs a reachable node, and a service
    must be able to start before the cluster does. Until one answers, every use raises the cluster
    client's RedisClusterException, which the services treat as Redis being away."""

    def __init__(self, build: Callable[[], redis.RedisCluster]) -> None:
        self._build = build
        self._client: redis.RedisCluster | None = None
        self._lock = threading.Lock()  # the worker's heartbeat thread shares the client

    @property
    def client(self) -> redis.RedisCluster:
        with self._lock:
            if self._client is None:
                self._client = self._build()
            return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def routed(pipe: Any, key: str) -> dict[str, Any]:
    """Options that send a script call on a sync cluster pipeline straight to the node of `key`'s slot:
    without them redis-py asks the server for the keys of every EVAL (COMMAND GETKEYS), a round trip per
    call. Elsewhere none are needed (one server; the asyncio cluster pipeline reads EVAL's keys itself)."""
    if isinstance(pipe, ClusterPipeline):
        return {"target_nodes": pipe.get_node_from_key(key)}
    return {}


# Asyncio clients: the gateway.

class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """Sentinel's primary with the gateway's bounded pool: a burst waits its turn for a connection."""


def async_client(url: str, max_connections: int, wait_seconds: float) -> Any:
    """A redis.asyncio client of what `url` names, with at most `max_connections` connections to one server
    (a burst waits up to `wait_seconds` for one)."""
    target = parse_redis_url(url)
    if target.mode == "single":
        return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=wait_seconds))
    if target.mode == "sentinel":
        return async_sentinel(target).master_for(
            target.service, connection_pool_class=_BlockingSentinelPool, connection_class=_AsyncPrimaryConnection,
            db=target.db, max_connections=max_connections, timeout=wait_seconds, **target.credentials())
    nodes = [aioredis.cluster.ClusterNode(host, port) for host, port in target.nodes]
    return _AsyncCluster(startup_nodes=nodes, max_connections=CLUSTER_NODE_CONNECTIONS,
                         maint_notifications_config=NO_MAINTENANCE, **target.credentials())


# redis-py's asyncio cluster client, on a connection to a node that has just died, can raise AttributeError
# or RuntimeError (a transport already closed by a concurrent disconnect) instead of a connection error: both
# are Redis being away to the gateway, which must answer 503 and end its streams cleanly.
_RACES = (AttributeError, RuntimeError)


def _lost(exc: Exception) -> RedisConnectionError:
    return RedisConnectionError(f"the connection to a Redis cluster node broke ({type(exc).__name__}: {exc})")


class _AsyncClusterPipeline(AsyncClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except _RACES as exc:
            raise _lost(exc) from exc


class _AsyncCluster(aioredis.RedisCluster):
    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except _RACES as exc:
            raise _lost(exc) from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> _AsyncClusterPipeline:
        if transaction or shard_hint:
            raise ValueError("a cluster pipeline takes neither a transaction nor a shard hint")
        return _AsyncClusterPipeline(self, transaction)


def async_sentinel(target: RedisTarget) -> AsyncSentinel:
    return AsyncSentinel(list(target.nodes), sentinel_kwargs={"socket_timeout": SENTINEL_TIMEOUT})
