"""Private Redis deployments on free loopback ports, for tests and benchmarks: a Redis Cluster of three
masters (`redis-server --cluster-enabled yes`, joined with `redis-cli --cluster create`) and a primary with
replicas watched by Sentinel (`redis-server --sentinel`). Each keeps nothing on disk but its
configuration, in a temporary directory, and gives the REDIS_URL that reaches it."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import redis

from llmserve.launcher import redis_command, redis_reachable
from llmserve.processes import free_port, popen, port_free, redis_server_binary, wait_until

# A cluster node also listens on its port + 10000 (the cluster bus).
BUS_OFFSET = 10000
NODE_TIMEOUT_MS = 2000


class Servers(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


G = TypeVar("G", bound=Servers)


def free_node_port(taken: set[int]) -> int:
    """A free port whose cluster-bus port is free as well."""
    for _ in range(200):
        port = free_port()
        if port + BUS_OFFSET < 65536 and port not in taken and port_free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def node_url(port: int) -> str:
    """The REDIS_URL of one server on loopback `port`."""
    return f"redis://127.0.0.1:{port}"


@dataclass
class Cluster:
    """A Redis Cluster. Without replicas, killing a master leaves its slots unserved until it returns; with
    them, a replica takes its slots over after the node timeout."""

    ports: list[int]
    workdir: tempfile.TemporaryDirectory[str]
    replicas: int = 0  # per master
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        port = self.ports[index]
        return popen([*redis_command(port), "--dir", self.workdir.name, "--dbfilename", f"dump-{port}.rdb",
                      "--repl-diskless-sync-delay", "0", "--cluster-enabled", "yes",
                      "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS)],
                     stdout=subprocess.DEVNULL)

    def start(self) -> None:
        self.processes = [self._spawn(i) for i in range(len(self.ports))]
        for port in self.ports:
            wait_until(lambda port=port: redis_reachable(node_url(port)), 10, f"cluster node on port {port}")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is needed to join the cluster")
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"], check=True, capture_output=True,
                       timeout=30)
        self.wait_ok()
        # A replica that has not synced yet could not take over from its master.
        wait_until(lambda: all(self._in_sync(port) for port in self.ports), 30, "the replicas in sync")

    def _in_sync(self, port: int) -> bool:
        info = redis.Redis(port=port).info("replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every node says the cluster serves all its slots."""
        wait_until(lambda: all(self.state(port) == "ok" for port in self.ports), timeout, "cluster_state:ok")

    def state(self, port: int) -> str:
        try:
            info = redis.Redis(port=port, socket_connect_timeout=0.5).cluster("INFO")
        except (redis.RedisError, OSError):
            return "unreachable"
        return str(info.get("cluster_state", ""))

    def kill(self, index: int) -> None:
        self.processes[index].kill()
        self.processes[index].wait()

    def restart(self, index: int) -> None:
        """The node again, from its cluster configuration: it serves its slots as before."""
        self.processes[index] = self._spawn(index)
        wait_until(lambda: redis_reachable(node_url(self.ports[index])), 10, "the restarted node")
        self.wait_ok()

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            process.wait(10)
        self.workdir.cleanup()


def free_node_ports(count: int) -> list[int]:
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_node_port(set(ports)))
    return ports


def started(group: G) -> G:
    """A group of servers started; one that fails to start is stopped, its processes and files gone."""
    try:
        group.start()
    except BaseException:
        group.stop()
        raise
    return group


def start_cluster(masters: int = 3, replicas: int = 0) -> Cluster:
    ports = free_node_ports(masters * (1 + replicas))
    return started(Cluster(ports, tempfile.TemporaryDirectory(prefix="llmserve-cluster-"), replicas))


@dataclass
class SentinelGroup:
    """A primary and its replicas (one by default) watched by one Sentinel (quorum 1) that fails over between
    them. With `write_replicas`, each data server runs with `min-replicas-to-write` so: a primary left with
    fewer replicas refuses writes (NOREPLICAS) instead of taking writes that a failover would drop."""

    service: str
    ports: list[int]  # the data servers, the first the primary at the start
    sentinel_port: int
    workdir: tempfile.TemporaryDirectory[str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)  # the data servers', then sentinels'
    write_replicas: int = 0

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.service}"

    @property
    def sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_connect_timeout=1)

    def primary_port(self) -> int:
        _, port = self.sentinel.sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def start(self) -> None:
        first, *others = self.ports
        self.processes.append(self.data_server(first))
        self.processes += [self.data_server(port, replica_of=first) for port in others]
        for port in self.ports:
            wait_until(lambda port=port: redis_reachable(node_url(port)), 10, f"redis-server on port {port}")
        self.processes.append(self.sentinel_server(self.sentinel_port, first, quorum=1))
        wait_until(self.ready, 30, "the replicas in sync and known to Sentinel")

    def data_server(self, port: int, replica_of: int | None = None) -> subprocess.Popen[bytes]:
        """A data server; a replica keeps the copy it receives in the group's directory."""
        replica = ["--replicaof", "127.0.0.1", str(replica_of)] if replica_of is not None else []
        durable = (["--min-replicas-to-write", str(self.write_replicas), "--min-replicas-max-lag", "2"]
                   if self.write_replicas else [])
        return popen([*redis_command(port), "--dir", self.workdir.name, "--dbfilename", f"dump-{port}.rdb",
                      "--repl-diskless-sync-delay", "0", *durable, *replica], stdout=subprocess.DEVNULL)

    def sentinel_server(self, port: int, primary: int, quorum: int) -> subprocess.Popen[bytes]:
        config = Path(self.workdir.name) / f"sentinel-{port}.conf"
        config.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.workdir.name}\n"
                          f"sentinel monitor {self.service} 127.0.0.1 {primary} {quorum}\n"
                          f"sentinel down-after-milliseconds {self.service} 1000\n"
                          f"sentinel failover-timeout {self.service} 5000\n")
        return popen([redis_server_binary(), str(config), "--sentinel"], stdout=subprocess.DEVNULL)

    def ready(self) -> bool:
        """Whether a failover could lose nothing now: every replica known healthy to Sentinel and in sync with
        the primary."""
        try:
            replicas = self.sentinel.sentinel_slaves(self.service)
            healthy = [r for r in replicas if r["is_slave"] and not (r["is_sdown"] or r["is_disconnected"])]
            return len(healthy) >= len(self.ports) - 1 and self._replicas_in_sync()
        except (redis.RedisError, OSError, StopIteration):
            return False

    def _replicas_in_sync(self) -> bool:
        """Each replica linked, and each acknowledging every write so far: a replica fresh from a full sync gets
        the primary's writes only after its first acknowledgement (up to a second later), while the primary
        already counts it for min-replicas-to-write."""
        primary = self.primary_port()
        others = [port for port in self.ports if port != primary]
        linked = all(redis.Redis(port=port).info("replication").get("master_link_status") == "up" for port in others)
        return linked and redis.Redis(port=primary).execute_command("WAIT", len(others), 500) >= len(others)

    def failover(self, timeout: float = 30) -> int:
        """Promote the replica now (`SENTINEL FAILOVER`); returns the new primary's port once Sentinel names
        it and it acts as one."""
        before = self.primary_port()
        self.sentinel.execute_command("SENTINEL", "FAILOVER", self.service)

        def promoted() -> int:
            port = self.primary_port()
            return port if port != before and redis.Redis(port=port).info("replication")["role"] == "master" else 0

        return wait_until(promoted, timeout, "the failover")

    def settle(self, timeout: float = 30) -> None:
        """Until the old primary follows the new one and Sentinel knows it again: ready to fail over back."""
        wait_until(self.ready, timeout, "the demoted primary to follow the new one")

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            process.wait(10)
        self.workdir.cleanup()


def start_sentinel(service: str = "llmserve", replicas: int = 1, write_replicas: int = 0) -> SentinelGroup:
    *data, sentinel_port = sorted(free_node_ports(replicas + 2))
    return started(SentinelGroup(service, data, sentinel_port, tempfile.TemporaryDirectory(prefix="llmserve-sentinel-"),
                                 write_replicas=write_replicas))
