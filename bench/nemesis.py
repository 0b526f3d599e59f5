"""The nemesis soak (issue 45): faults together, on a schedule, under a steady load, and a checker over every
request's history afterwards.

The stack: two gateways, three workers, two schedulers (one leads by its lease, the other stands by), Redis
behind Sentinel (a primary and a replica run with min-replicas-to-write 1, three sentinels, quorum 2), every
one a process of its own on free loopback ports; the last worker reaches Redis through a proxy
(harness/proxy.py). The load: closed-loop streaming clients (greedy, a fixed max_tokens, ignore_eos) that resume
on the other gateway with Last-Event-ID whenever their connection breaks, and submit again when their request
ends with `redis_unavailable` (what a Redis failover does to the streams in flight: docs/faults.md). The
nemesis, on a schedule drawn from --seed (rounds of every fault in a shuffled order, at random gaps):

  worker_kill9, worker_sigterm, gateway_kill9, gateway_sigterm, scheduler_kill9 and scheduler_sigterm (of the
  leader): each process restarted by the launcher's Supervisor after its backoff (1 s first), as `llmserve
  up` does; worker_sigstop: a worker frozen past WORKER_TTL, then SIGCONT; redis_failover (SENTINEL FAILOVER)
  and redis_kill9 (of the primary, restarted as a replica of the new one a few seconds later); client_vanish:
  a client closes its stream and never resumes it (its request must be cancelled, or have finished first);
  network_delay: every chunk between the proxied worker and Redis (its sentinel answers too) held NETWORK_DELAY_S
  each way for a few seconds; network_cut: nothing through until past its WORKER_TTL, then all of it.

The checker, once the load has stopped and the stack settled: each stream (but the vanished) whole, every token
index once and in order, with its end; its text equal to the fault-free text of its prompt (each prompt run once
before the faults); no request finished twice (the `finished` hops of its trace); the vanished cancelled or done;
no key of a request or of a gone worker left without a TTL, no slot held (no assignment, nothing queued, no
lease, nothing in flight); each service's RSS at the start of the faulty phase and at the end, for the processes
that lived through it, and over each process's own life, where no process may grow past its service's bound
(MEMORY_BOUND_MB). Prints a summary and writes bench/results/nemesis-<host kind>.json (nemesis-hf-... with
--engine hf), or --out."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.clients import sync_client  # noqa: E402
from common.keys import Keys  # noqa: E402
from common.protocol import TraceEvent, decode  # noqa: E402
from harness.proxy import SentinelProxy  # noqa: E402
from harness.sse import parse  # noqa: E402
from harness.stacks import PrivateStack, lasting, live_workers, pid_of  # noqa: E402
from harness.topology import SentinelGroup, free_node_ports, started  # noqa: E402
from llmserve.launcher import Stack, Supervisor, gateway_ports, serving  # noqa: E402
from llmserve.processes import free_ports, wait_until  # noqa: E402

NS = "nemesis"
KEYS = Keys(NS)
WORKERS, GATEWAYS, SCHEDULERS, SENTINELS = 3, 2, 2, 3
DATA_SERVERS, WRITE_REPLICAS = 2, 1
WORKER_TTL = 3.0
RESUME_GRACE = 3.0
FAULTS = ("worker_kill9", "worker_sigterm", "worker_sigstop", "gateway_kill9", "gateway_sigterm",
          "scheduler_kill9", "scheduler_sigterm", "redis_failover", "redis_kill9", "client_vanish", "network_delay",
          "network_cut")
# What network_delay adds to each chunk, each way, between the proxied worker and Redis (sentinels included).
NETWORK_DELAY_S = 0.25
# The error a client may meet and submit again for: what a Redis failover does to the streams in flight.
EXPECTED_ERRORS = ("redis_unavailable",)
TOPICS = ("ships", "bread", "rivers", "clocks", "bees", "glass", "trains", "paper", "salt", "maps", "bells",
          "kites", "wool", "tea", "ice", "stone")


@dataclass
class Options:
    minutes: float = 2.0  # the faulty phase
    engine: str = "sim"
    seed: int = 45
    clients: int = 0  # 0: the engine's default
    tokens: int = 0
    warmup_s: float = 10.0  # load without faults before the faulty phase (the RSS baseline is taken after it)
    gap_s: tuple[float, float] = (3.0, 8.0)  # between two faults
    settle_s: float = 120.0  # the longest wait for the stack to settle once the load has stopped
    out: Path | None = None

    def __post_init__(self) -> None:
        hf = self.engine == "hf"
        self.clients = self.clients or (4 if hf else 12)
        self.tokens = self.tokens or (32 if hf else 200)

    @property
    def job_deadline_s(self) -> float:
        """How long a client keeps trying one request (resuming, submitting again) before it counts it lost."""
        return 600.0 if self.engine == "hf" else 240.0

    def settings(self) -> dict[str, str]:
        common = {"NAMESPACE": NS, "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": str(WORKER_TTL),
                  "LOG_LEVEL": "WARNING", "MIGRATION_LIMIT": "1000", "RESUME_GRACE": str(RESUME_GRACE),
                  # Every request's trace outlives the run: the checker reads them all at the end.
                  "TRACE_TTL": str(int(self.minutes * 60 + self.warmup_s + 1800)), "WORKER_THREADS": "1"}
        if self.engine == "hf":
            return {**common, "ENGINE": "hf"}
        return {**common, "ENGINE": "sim", "MODEL": "sim", "SIM_STEP_MS": "20"}

    def prompts(self) -> list[str]:
        # Of different lengths: the sim's text depends on the prompt's length alone.
        count = 6 if self.engine == "hf" else len(TOPICS)
        return [f"Write a long essay about {topic}." + " Go on." * i for i, topic in enumerate(TOPICS[:count])]

    def body(self, prompt: str) -> dict[str, object]:
        return {"prompt": prompt, "max_tokens": self.tokens, "temperature": 0, "ignore_eos": True}


# Redis: a primary and a replica watched by three sentinels; a primary takes a write only while its replica
# follows it (min-replicas-to-write 1), so that the old primary of a failover refuses the writes its demotion
# would drop (bench/sentinel_writes.py).

@dataclass
class Quorum(SentinelGroup):
    """harness/topology.py's SentinelGroup with three sentinels (quorum 2) in place of one, and the primary
    killed and restarted as a supervisor would."""

    sentinel_ports: list[int] = field(default_factory=list)
    proxy: SentinelProxy | None = None  # between the last worker and the group, for the network faults

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{self.service}"

    @property
    def sentinel(self) -> redis.Redis:
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=2)
            with contextlib.suppress(redis.RedisError, OSError):
                if client.ping():
                    return client
        raise redis.ConnectionError("no sentinel answers")

    def start(self) -> None:
        super().start()  # the data servers and the first sentinel
        primary = self.primary_port()
        self.processes += [self.sentinel_server(port, primary, quorum=2) for port in self.sentinel_ports[1:]]
        redis.Redis(port=self.sentinel_port).execute_command("SENTINEL", "SET", self.service, "quorum", "2")
        wait_until(lambda: all(self._peers(port) == SENTINELS - 1 for port in self.sentinel_ports), 60,
                   "the sentinels to know one another")
        self.proxy = SentinelProxy(self.sentinel_ports, self.service)
        self.proxy.start()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        super().stop()

    def _peers(self, port: int) -> int:
        with contextlib.suppress(redis.RedisError, OSError):
            return len(redis.Redis(port=port, socket_timeout=2).sentinel_sentinels(self.service))
        return -1

    def ask_failover(self) -> int:
        """SENTINEL FAILOVER, without waiting for it; returns the primary's port before it."""
        before = self.primary_port()
        self.sentinel.execute_command("SENTINEL", "FAILOVER", self.service)
        return before

    def kill_primary(self) -> int:
        """kill -9 of the primary; returns its place."""
        place = self.ports.index(self.primary_port())
        self.processes[place].kill()
        self.processes[place].wait()
        return place

    def restart_as_replica(self, place: int) -> bool:
        """Start the killed server again as a replica of the primary Sentinel names now; False while Sentinel
        still names the dead one."""
        port = self.ports[place]
        with contextlib.suppress(redis.RedisError, OSError):
            primary = self.primary_port()
            if primary != port:
                self.processes[place] = self.data_server(port, replica_of=primary)
                return True
        return False

    def pids(self) -> dict[str, int]:
        return {f"redis:{port}": p.pid for port, p in zip(self.ports, self.processes, strict=False)}


def start_quorum(service: str = "llmserve") -> Quorum:
    ports = sorted(free_node_ports(DATA_SERVERS + SENTINELS))
    data, sentinels = ports[:DATA_SERVERS], ports[DATA_SERVERS:]
    return started(Quorum(service, data, sentinels[0], tempfile.TemporaryDirectory(prefix="llmserve-nemesis-"),
                          write_replicas=WRITE_REPLICAS, sentinel_ports=sentinels))



# The stack on it.

@contextlib.contextmanager
def nemesis_stack(options: Options) -> Iterator[PrivateStack]:
    """harness.stacks.private_stack's stack with two schedulers, on a Quorum; yields once every gateway sees every
    worker."""
    group = start_quorum()
    try:
        env = {**os.environ, "REDIS_URL": group.url, "GATEWAY_HOST": "127.0.0.1",
               "GATEWAY_PORT": str(free_ports(GATEWAYS)), **options.settings(),
               "SCHEDULER_METRICS_PORT": str(free_ports(SCHEDULERS)), "WORKER_METRICS_PORT": str(free_ports(WORKERS))}
        stack = Stack(env)
        urls = [f"http://127.0.0.1:{port}" for port in gateway_ports(env, GATEWAYS)]
        running = PrivateStack(urls[0], stack, group.url, None, urls, group)
        try:
            stack.start(WORKERS - 1, GATEWAYS)
            for _ in range(SCHEDULERS - 1):
                stack.spawn("scheduler")  # a standby
            stack.spawn("worker", REDIS_URL=group.proxy.url)  # the network faults' worker, last of the workers
            for url in urls:
                wait_until(lambda url=url: serving(url, WORKERS, stack), 600, f"{WORKERS} workers behind {url}", 0.5)
            yield running
        finally:
            for _, process in stack.processes:  # a frozen process would not hear its SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
            stack.stop()
    finally:
        group.stop()


def places(stack: Stack, name: str) -> list[int]:
    """The indexes in stack.processes of a service's processes: a restart keeps its process's place."""
    return [i for i, (service, _) in enumerate(stack.processes) if service == name]


# The clients.

@dataclass
class Attempt:
    """One request (one request id) as its client read it, over one or more connections."""

    request_id: str = ""
    indexes: list[int] = field(default_factory=list)
    text: str = ""
    last_id: str | None = None
    connections: int = 0
    resumes: int = 0  # resumed connections (200) after a break
    ended: str = ""  # done, done:204, error:<code>, gone:<status>, vanished, or '' (given up)
    final: dict = field(default_factory=dict)
    # (time.monotonic(), what) of each connection's start and end: where a stream's trouble came from.
    history: list[tuple[float, str]] = field(default_factory=list)
    last_seen: float = 0.0  # time.monotonic() of its last event

    def lived(self) -> tuple[float, float]:
        """From its POST to its last event or connection."""
        times = [at for at, _ in self.history] + [self.last_seen or 0.0]
        return (self.history[0][0], max(times)) if self.history else (0.0, 0.0)

    def outage(self) -> float:
        """The longest time between a break of this stream and the next connection a gateway answered."""
        longest, broke = 0.0, None
        for at, what in self.history:
            if what.startswith(("broke", "closed")):
                broke = at if broke is None else broke
            elif broke is not None and what.split(":")[-1].isdigit():
                longest, broke = max(longest, at - broke), None
        return longest

    def told(self, since: float) -> str:
        return " ".join(f"{what}@{at - since:.2f}" for at, what in self.history)


@dataclass
class Job:
    """What one client wanted once: a prompt's completion, through as many requests as it took."""

    client: int
    prompt: str
    started: float
    attempts: list[Attempt] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # each token's arrival, across attempts
    outcome: str = "running"  # completed, vanished or lost
    ended: float = 0.0
    submit_retries: int = 0  # a POST that got no stream (503, a dead gateway)


class Client:
    """A closed loop of streams: the next starts when one ends, on alternate gateways."""

    def __init__(self, number: int, urls: list[str], options: Options, stop: threading.Event) -> None:
        self.number, self.urls, self.options, self.stop = number, urls, options, stop
        self.rng = random.Random(options.seed * 1000 + number)
        self.jobs: list[Job] = []
        self.vanish = threading.Event()  # set by the nemesis: leave the current stream for good
        self.turn = number
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name=f"client-{number}", daemon=True)

    def _url(self, other: bool = True) -> str:
        if other:
            self.turn += 1
        return self.urls[self.turn % len(self.urls)]

    def _run(self) -> None:
        prompts = self.options.prompts()
        timeout = httpx.Timeout(60.0, connect=5.0)
        with httpx.Client(timeout=timeout) as http:
            while not self.stop.is_set():
                job = Job(self.number, self.rng.choice(prompts), time.monotonic())
                self.jobs.append(job)
                try:
                    self._job(http, job)
                except Exception as exc:  # a bug of this script: reported, never a silent thread death
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    job.outcome = "lost"
                job.ended = time.monotonic()

    def _job(self, http: httpx.Client, job: Job) -> None:
        deadline = job.started + self.options.job_deadline_s
        backoff = 0.1
        while time.monotonic() < deadline:
            attempt = Attempt()
            job.attempts.append(attempt)
            outcome = self._submit(http, job, attempt, deadline)
            while outcome == "break" and time.monotonic() < deadline:
                outcome = self._resume(http, job, attempt, deadline)
            if outcome == "vanished":
                job.outcome = "vanished"
                return
            if attempt.ended.startswith("done"):
                job.outcome = "completed"
                return
            # An error event, or a stream nobody can resume (404): submit it again, as a client would.
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        job.outcome = "lost"

    def _submit(self, http: httpx.Client, job: Job, attempt: Attempt, deadline: float) -> str:
        backoff = 0.05
        while time.monotonic() < deadline:
            try:
                with http.stream("POST", f"{self._url()}/generate_stream", json=self.options.body(job.prompt)) as got:
                    if got.status_code == 200:
                        attempt.request_id = got.headers["x-request-id"]
                        attempt.connections += 1
                        attempt.history.append((time.monotonic(), f"post:{self.turn % len(self.urls)}"))
                        return self._read(got, job, attempt)
                    got.read()
            except httpx.HTTPError:
                pass  # a gateway gone: the request, if it was admitted, is cancelled (its id never seen)
            job.submit_retries += 1
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
        return "deadline"

    def _resume(self, http: httpx.Client, job: Job, attempt: Attempt, deadline: float) -> str:
        """Resume on the other gateway from the last event seen; 'break' again if that connection breaks."""
        backoff = 0.05
        while time.monotonic() < deadline:
            headers = {"Last-Event-ID": attempt.last_id} if attempt.last_id is not None else {}
            try:
                with http.stream("GET", f"{self._url()}/v1/requests/{attempt.request_id}/stream",
                                 headers=headers) as got:
                    attempt.history.append((time.monotonic(), f"get:{self.turn % len(self.urls)}:{got.status_code}"))
                    if got.status_code == 200:
                        attempt.connections += 1
                        attempt.resumes += 1
                        return self._read(got, job, attempt)
                    got.read()
                    if got.status_code == 204:  # nothing left to send: it had all but the end
                        attempt.ended = "done:204"
                        return "end"
                    if got.status_code == 404:  # gone with a Redis that lost it
                        attempt.ended = "gone:404"
                        return "end"
            except httpx.HTTPError as exc:
                attempt.history.append((time.monotonic(), f"get:{self.turn % len(self.urls)}:{type(exc).__name__}"))
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
        return "deadline"

    def _read(self, response: httpx.Response, job: Job, attempt: Attempt) -> str:
        """Read a stream's events: 'end' at its end or error event, 'vanished', or 'break'."""
        try:
            for event in parse(response.iter_lines()):
                attempt.last_seen = time.monotonic()
                if event.id is not None:
                    attempt.last_id = event.id
                data = event.data
                if "index" in data:
                    job.arrivals.append(time.monotonic())
                    attempt.indexes.append(data["index"])
                    attempt.text += data["token"]
                    if self.vanish.is_set():
                        self.vanish.clear()
                        attempt.ended = "vanished"
                        return "vanished"  # the connection closes as the `with` ends, and nobody resumes
                elif event.event == "error":
                    attempt.ended, attempt.final = f"error:{data.get('error', {}).get('code')}", data
                    return "end"
                elif "finish_reason" in data:
                    attempt.ended, attempt.final = "done", data
                    return "end"
        except httpx.HTTPError as exc:
            attempt.history.append((time.monotonic(), f"broke:{type(exc).__name__}:{len(attempt.indexes)}"))
            return "break"
        attempt.history.append((time.monotonic(), f"closed:{len(attempt.indexes)}"))
        return "break"


# The nemesis.

@dataclass
class Fault:
    at_s: float  # planned, from the start of the faulty phase
    fault: str
    target: int  # the place of the worker or gateway, the client; 0 where there is one choice (leader, primary)
    hold_s: float  # how long a frozen worker stays frozen, a killed primary down, the network slow or cut
    done_s: float | None = None  # when it struck
    detail: dict = field(default_factory=dict)

    def logged(self) -> dict[str, object]:
        detail = {key: value for key, value in self.detail.items() if key != "at_monotonic"}
        return {"at_s": round(self.done_s, 3) if self.done_s is not None else None, "planned_s": round(self.at_s, 3),
                "fault": self.fault, "target": self.target, "hold_s": round(self.hold_s, 2), **detail}


def schedule(options: Options) -> list[Fault]:
    """Rounds of every fault in a shuffled order at random gaps, all drawn from the seed: the same seed, the
    same schedule."""
    rng = random.Random(options.seed)
    faults, at, end = [], 0.0, options.minutes * 60
    while True:
        for kind in rng.sample(FAULTS, len(FAULTS)):
            at += rng.uniform(*options.gap_s)
            if at >= end:
                return faults
            target = {"worker": rng.randrange(WORKERS), "gateway": rng.randrange(GATEWAYS),
                      "client": rng.randrange(options.clients)}.get(kind.split("_")[0], 0)
            faults.append(Fault(at, kind, target, hold(kind, rng)))


def hold(kind: str, rng: random.Random) -> float:
    if kind in ("worker_sigstop", "network_cut"):  # past the worker's TTL: its streams move
        return WORKER_TTL + rng.uniform(1, 3)
    return {"redis_kill9": rng.uniform(2, 4), "network_delay": rng.uniform(3, 6)}.get(kind, 0.0)


class Nemesis:
    """Strikes the schedule from the main thread (the services it restarts must be children of it), runs the
    launcher's Supervisor, and carries out what a fault leaves to do later (a SIGCONT, a primary's restart)."""

    def __init__(self, running: PrivateStack, clients: list[Client], plan: list[Fault]) -> None:
        self.running, self.stack, self.group = running, running.stack, running.topology
        self.clients, self.plan = clients, plan
        self.supervisor = Supervisor(self.stack, first_s=1.0, cap_s=4.0, steady_s=15.0)
        self.later: list[tuple[float, Callable[[], bool]]] = []  # (when, action): an action returning False waits
        self.frozen: set[int] = set()
        self.ever_frozen: set[int] = set()
        self.redis = sync_client(running.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.started = 0.0
        self.memory: dict[int, Memory] = {}
        self.sampled = 0.0

    def run(self, seconds: float, log: Callable[[str], None]) -> None:
        self.started = time.monotonic()
        queue = list(self.plan)
        told = self.started
        while queue or self.later or time.monotonic() - self.started < seconds:
            self.tick()
            # Due faults in order; one that must wait (a Redis fault, until the group is ready for another) does
            # not hold back the others.
            for fault in [f for f in queue if time.monotonic() - self.started >= f.at_s]:
                if self.strike(fault):
                    queue.remove(fault)
                    log(f"  {json.dumps(fault.logged())}")
                elif time.monotonic() - self.started > fault.at_s + 60:
                    fault.detail["skipped"] = "it could not strike within 60 s"
                    queue.remove(fault)
            if not queue and not self.later and time.monotonic() - self.started >= seconds:
                break
            if time.monotonic() - told >= 30:
                told = time.monotonic()
                jobs = [job for client in self.clients for job in client.jobs]
                log(f"  {told - self.started:7.1f} s: {sum(j.outcome == 'completed' for j in jobs)} streams "
                    f"completed, {sum(j.outcome == 'lost' for j in jobs)} lost")
            time.sleep(0.05)

    def tick(self) -> None:
        now = time.monotonic()
        for entry in list(self.later):
            when, action = entry
            if now >= when and action():
                self.later.remove(entry)
        self.supervisor.check()
        if now - self.sampled >= MEMORY_EVERY_S:
            self.sampled = now
            for pid, (name, rss) in rss_of(self.stack).items():
                self.memory.setdefault(pid, Memory(name, now)).sample(now, rss)

    def strike(self, fault: Fault) -> bool:
        """The fault now; False to wait (a Redis fault waits for the group to be ready for another)."""
        kind = fault.fault
        if kind.startswith("redis"):
            if not self.group.ready():
                return False
            if kind == "redis_failover":
                fault.detail["primary_port"] = self.group.ask_failover()
            else:
                place = self.group.kill_primary()
                fault.detail["primary_port"] = self.group.ports[place]
                self.later.append((time.monotonic() + fault.hold_s, lambda: self.group.restart_as_replica(place)))
        elif kind == "client_vanish":
            self.clients[fault.target].vanish.set()
        elif kind.startswith("network"):
            proxy = self.group.proxy
            if kind == "network_delay":
                proxy.delay(NETWORK_DELAY_S)
            else:  # cut off past its TTL: the worker must act as one woken from a freeze
                proxy.cut()
                self.ever_frozen.add(self.stack.processes[places(self.stack, "worker")[-1]][1].pid)
            self.later.append((time.monotonic() + fault.hold_s, lambda: proxy.heal() or True))
        else:
            service, how = kind.split("_")
            if service == "scheduler":
                place = self._leader_place()
                if place is None:
                    return False
            else:
                place = places(self.stack, service)[fault.target]
            process = self.stack.processes[place][1]
            fault.detail |= {"pid": process.pid}
            if process.poll() is not None:
                fault.detail["note"] = "already down"
            elif how == "sigstop":
                os.kill(process.pid, signal.SIGSTOP)
                self.frozen.add(process.pid)
                self.ever_frozen.add(process.pid)
                self.later.append((time.monotonic() + fault.hold_s, lambda pid=process.pid: self._thaw(pid)))
            else:
                os.kill(process.pid, signal.SIGKILL if how == "kill9" else signal.SIGTERM)
        fault.done_s = time.monotonic() - self.started
        fault.detail["at_monotonic"] = time.monotonic()
        return True

    def _thaw(self, pid: int) -> bool:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.frozen.discard(pid)
        return True

    def _leader_place(self) -> int | None:
        try:
            leader = self.redis.get(KEYS.lease)
        except (redis.RedisError, OSError):
            return None
        if not leader:
            return None
        pid = pid_of(leader)
        return next((i for i in places(self.stack, "scheduler") if self.stack.processes[i][1].pid == pid), None)

    def whole(self) -> bool:
        """Every service up and serving again, the Redis group ready."""
        self.tick()
        if self.later or any(p.poll() is not None for _, p in self.stack.processes):
            return False
        if not self.group.ready():
            return False
        try:
            return all(httpx.get(f"{url}/health", timeout=5).json().get("workers") == WORKERS
                       for url in self.running.urls)
        except (httpx.HTTPError, ValueError):
            return False


# What is left in Redis.

def kind_of(key: str) -> str:
    """A key's kind: a shared one's name, a request's kind (out, progress, log, trace...), worker:<kind>."""
    shared = f"{{{NS}}}:"
    if key.startswith(shared):
        name = key[len(shared):]
        return name.split(":")[0] if name.split(":")[0] in ("worker", "tokens", "inflight", "quota") else name
    if KEYS.worker_of(key) is not None:
        return "worker:" + key.rsplit(":", 1)[1]
    return key.removeprefix(f"{NS}:").split(":")[0]


def key_census(r: redis.Redis) -> dict[str, dict[str, int]]:
    """Per kind: how many keys, and how many of them without a TTL."""
    census: dict[str, dict[str, int]] = {}
    for raw in r.scan_iter(count=1000):
        key = raw.decode()
        entry = census.setdefault(kind_of(key), {"keys": 0, "without_ttl": 0})
        entry["keys"] += 1
        entry["without_ttl"] += r.ttl(raw) == -1
    return dict(sorted(census.items()))


def held(r: redis.Redis) -> dict[str, int]:
    """What must be back to nothing once no request runs: assignments, the queue, leases, requests in flight,
    the keys of workers that are gone."""
    live = live_workers(r, KEYS)
    assigned, gone = 0, 0
    for raw in r.scan_iter(match=KEYS.worker_keys(), count=1000):
        key = raw.decode()
        if KEYS.worker_of(key) not in live:
            gone += 1
        elif key.endswith(":assigned"):
            assigned += r.hlen(raw)
    in_flight = sum(r.zcard(key) for key in r.scan_iter(match=f"{{{NS}}}:inflight:*", count=1000))
    return {"assigned": assigned, "queued": int(r.get(KEYS.queued) or 0),
            "queued_bytes": int(r.get(KEYS.queued_bytes) or 0), "requests_stream": r.xlen(KEYS.requests),
            "leases": r.zcard(KEYS.leases), "in_flight": in_flight, "keys_of_gone_workers": gone,
            "progress_lists": sum(1 for _ in r.scan_iter(match=f"{NS}:progress:*", count=1000))}


def holding(left: dict[str, int]) -> int:
    return sum(value for name, value in left.items() if name != "progress_lists")


def settle(r: redis.Redis, timeout: float, log: Callable[[str], None]) -> dict[str, int]:
    """Wait for nothing to be held; what is held still once it has not changed for a while (past the resume
    grace of the vanished and the TTL of a lost worker), or at `timeout`, is what stays."""
    start = time.monotonic()
    floor = 2 * RESUME_GRACE + 2 * WORKER_TTL + 5
    last, since = held(r), time.monotonic()
    while holding(last) and time.monotonic() - start < timeout:
        time.sleep(1.0)
        now = held(r)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 20 and time.monotonic() - start >= floor:
            break
    log(f"settled after {time.monotonic() - start:.0f} s: {json.dumps(last)}")
    return last


def hops(r: redis.Redis, request_id: str) -> list[TraceEvent]:
    return [decode(item, TraceEvent, 1 << 20) for item in r.lrange(KEYS.trace(request_id), 0, -1)]


# Memory.

def rss_of(stack: Stack) -> dict[int, tuple[str, int]]:
    """pid -> (service, RSS in bytes) of every live service process."""
    sizes = {}
    for name, process in stack.processes:
        with contextlib.suppress(psutil.Error):
            if process.poll() is None:
                sizes[process.pid] = (name, psutil.Process(process.pid).memory_info().rss)
    return sizes


MEMORY_EVERY_S = 5.0
# A process's memory is compared from this age on: its imports and first requests are done by then.
MEMORY_SETTLED_S = 30.0
# How far a process's RSS may grow over its life (from MEMORY_SETTLED_S of age, sampled for at least a minute) before
# `memory_grew` counts it (docs/faults.md, "Faults together"): a few MB for the gateways, the schedulers and the
# sim's workers, whose lives in both soaks grew by 0.8 MB at most; for a worker of the real model, the whole of its
# warm-up measured alone (580 to 630 MB, all within its first minute), which the soak's sampling from 30 s of age
# overlaps: more than all of it after that is not warm-up.
MEMORY_BOUND_MB = {"gateway": 5.0, "scheduler": 5.0, "worker": 5.0}
HF_WORKER_BOUND_MB = 50.0


@dataclass
class Memory:
    """One service process's RSS over its life, as the nemesis sampled it."""

    service: str
    seen: float  # when first sampled (about its start)
    first: tuple[float, int] | None = None  # (when, RSS) of the first sample MEMORY_SETTLED_S after `seen`
    last: tuple[float, int] | None = None

    def sample(self, now: float, rss: int) -> None:
        if rss <= 0:  # a process on its way out (a zombie's RSS reads 0): not its memory
            return
        if now - self.seen >= MEMORY_SETTLED_S:
            self.first = self.first or (now, rss)
            self.last = (now, rss)


def rss_over_lives(memory: dict[int, Memory], at_least_s: float) -> list[dict[str, object]]:
    """The RSS growth of each process sampled over at least `at_least_s` (from MEMORY_SETTLED_S of age)."""
    mb = 1 << 20
    return [{"service": m.service, "pid": pid, "sampled_s": round(m.last[0] - m.first[0]),
             "start_mb": round(m.first[1] / mb, 1), "end_mb": round(m.last[1] / mb, 1),
             "growth_mb": round((m.last[1] - m.first[1]) / mb, 1)}
            for pid, m in sorted(memory.items())
            if m.first is not None and m.last is not None and m.last[0] - m.first[0] >= at_least_s]


def memory_bound_mb(service: str, engine: str) -> float:
    """How much a process of `service` may grow over its life (MEMORY_BOUND_MB)."""
    return HF_WORKER_BOUND_MB if service == "worker" and engine == "hf" else MEMORY_BOUND_MB[service]


def grown(lives: list[dict[str, object]], engine: str) -> list[dict[str, object]]:
    """The processes of `lives` (rss_over_lives) that grew past their service's bound."""
    return [life for life in lives if life["growth_mb"] > memory_bound_mb(str(life["service"]), engine)]


def rss_growth(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> list[dict[str, object]]:
    mb = 1 << 20
    return [{"service": name, "pid": pid, "start_mb": round(start / mb, 1), "end_mb": round(after[pid][1] / mb, 1),
             "growth_mb": round((after[pid][1] - start) / mb, 1),
             "growth_pct": round(100 * (after[pid][1] - start) / start, 1)}
            for pid, (name, start) in sorted(before.items()) if pid in after]


# The checker.

def quantiles(values: list[float]) -> dict[str, float | int | None]:
    values = sorted(values)
    if not values:
        return {"n": 0, "median": None, "p90": None, "max": None}
    return {"n": len(values), "median": round(statistics.median(values), 3),
            "p90": round(values[min(len(values) - 1, round(0.9 * (len(values) - 1)))], 3),
            "max": round(values[-1], 3)}


def next_token_times(jobs: list[Job], faults: list[Fault]) -> dict[str, object]:
    """For each fault and each stream under way when it struck (a token before it, one after), the time from
    the fault to that stream's next token; over all streams, and the worst stream of each fault."""
    every: dict[str, list[float]] = {}
    worst: dict[str, list[float]] = {}
    for fault in faults:
        at = fault.detail.get("at_monotonic")
        if at is None or fault.fault == "client_vanish":
            continue
        gaps = []
        for job in jobs:
            i = bisect.bisect_left(job.arrivals, at)
            if 0 < i < len(job.arrivals):
                gaps.append(job.arrivals[i] - at)
        every.setdefault(fault.fault, []).extend(gaps)
        if gaps:
            worst.setdefault(fault.fault, []).append(max(gaps))
    return {"all_faults": quantiles([g for gaps in every.values() for g in gaps]),
            "worst_stream_per_fault": quantiles([g for gaps in worst.values() for g in gaps]),
            "by_fault": {kind: {"streams": quantiles(every[kind]), "worst_stream": quantiles(worst.get(kind, []))}
                         for kind in sorted(every)}}


def journey(trace: list[TraceEvent], since: float | None = None) -> str:
    """A trace in one line: each hop, seconds from `since` (time.time(); else from the first), and the worker where
    one is named."""
    start = since if since is not None else trace[0].at if trace else 0.0
    return " ".join(f"{h.hop}@{h.at - start:.2f}" + (f"[{h.detail['worker_id']}]" if "worker_id" in h.detail
                                                      else "") for h in trace)


def check(jobs: list[Job], expected: dict[str, str], tokens: int, r: redis.Redis,
          frozen: set[int] = frozenset(), since: float = 0.0,
          windows: list[tuple[float, float]] = ()) -> dict[str, object]:
    """The verdicts over every request's history; `frozen`: the pids of the workers the nemesis froze; `since`: the
    time.monotonic() the examples count from (the faulty phase's start)."""
    since_wall = time.time() - (time.monotonic() - since)
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}

    def bad(what: str, request_id: str, why: str = "") -> None:
        counts[what] += 1
        examples.setdefault(what, [])
        if len(examples[what]) < 5:
            examples[what].append(f"{request_id} {why}".strip())

    for job in jobs:
        counts["jobs"] += 1
        counts[f"jobs_{job.outcome}"] += 1
        counts["jobs_resumed"] += any(a.resumes for a in job.attempts)
        counts["resumes"] += sum(a.resumes for a in job.attempts)
        counts["submit_retries"] += job.submit_retries
        if job.outcome == "lost":
            bad("lost", job.attempts[-1].request_id if job.attempts else "-", f"job of client {job.client}: "
                f"{[a.ended for a in job.attempts]} {job.attempts[-1].told(since) if job.attempts else ''}")
        for attempt in job.attempts:
            if not attempt.request_id:
                continue
            counts["requests"] += 1
            trace = hops(r, attempt.request_id)
            finished = [h for h in trace if h.hop == "finished"]
            counts["migrated"] += sum(h.hop == "migrated" for h in trace)
            counts["requests_without_trace"] += not trace
            # What a verdict against this request is put down to, where the services' known faults explain it:
            # a worker the nemesis froze ran it, or the start of its trace is gone (written to a primary that a
            # failover then dropped: its `received` hop is missing).
            cause = cause_of(trace, frozen, attempt.lived(), windows)

            def verdict(what: str, why: str, attempt: Attempt = attempt, trace: list = trace,
                        cause: str = cause) -> None:
                bad(what, attempt.request_id, f"{why} ended: {attempt.ended} {json.dumps(attempt.final)} client: "
                    f"{attempt.told(since)} trace: {journey(trace, since_wall)}")
                if cause:
                    counts[f"{what}_{cause}"] += 1

            seen = set(attempt.indexes)
            if len(seen) != len(attempt.indexes):
                verdict("duplicated", f"{len(attempt.indexes) - len(seen)} indexes twice")
            if attempt.indexes != sorted(attempt.indexes) or sorted(seen) != list(range(len(seen))):
                verdict("lost", f"gaps or disorder: {attempt.indexes[:3]}...")
            if attempt.ended.startswith("error:"):
                code = attempt.ended.split(":", 1)[1]
                errors[code] += 1
                if code == "cancelled" and attempt.outage() >= 0.75 * RESUME_GRACE:
                    # No gateway answered for as long as the stream's lease lasts: cancelled as documented.
                    counts["cancelled_after_an_outage_of_both_gateways"] += 1
                elif code not in EXPECTED_ERRORS:
                    verdict("unexpected_errors", "")
            elif attempt.ended.startswith("gone"):
                errors[attempt.ended] += 1
            if attempt.ended.startswith("done"):
                counts["completed"] += 1
                if attempt.indexes != list(range(tokens)):
                    verdict("lost", f"completed with {len(attempt.indexes)} of {tokens} tokens")
                if attempt.text != expected[job.prompt]:
                    verdict("texts_unequal", repr(attempt.text[:40]))
            if len(finished) > 1:
                verdict("run_twice", "")
            if attempt.ended == "vanished":
                counts["vanished"] += 1
                fate = "cancelled" if any(h.hop == "cancelled" for h in trace) else "finished" if finished else \
                    "trace_lost" if not trace else "neither"
                counts[f"vanished_{fate}"] += 1
                if fate == "neither":
                    verdict("vanished_left_running", "")
    return {"counts": dict(sorted(counts.items())), "errors_by_code": dict(errors),
            "examples": examples}


# What the checker tells apart in a request's history (docs/faults.md, "Faults together"): writes a primary took and
# then lost (a trace that lost its start shows it), the one fault of Redis' asynchronous replication still open with
# min-replicas-to-write 1 (a primary killed with kill -9 before its replica had them), which EXPLAINED puts things
# down to; a request that lived through the window in which a failover's old primary used to take writes it then
# dropped (closed by min-replicas-to-write 1: the old primary refuses them) and a worker frozen past its TTL that
# went on, once it woke, with what was moved away from it (fixed) are only labelled. The report's `ok`, which the
# soak's exit status and tests/test_nemesis.py go by, excuses nothing.
CAUSES = ("after_lost_writes", "in_a_failover_window", "by_a_woken_worker")
EXPLAINED = ("after_lost_writes",)
# The window in which the services may go on writing to a primary that a failover or a kill -9 drops: Sentinel
# demotes the old primary about 10 s after SENTINEL FAILOVER; a killed one loses what it had not replicated.
SPLIT_S = {"redis_failover": 15.0, "redis_kill9": 5.0}


def cause_of(trace: list[TraceEvent], frozen: set[int], lived: tuple[float, float] = (0.0, 0.0),
             windows: list[tuple[float, float]] = ()) -> str:
    """The known fault a request's trace (or its life, against the failovers' windows) shows, of CAUSES, or ''."""
    if not any(h.hop == "received" for h in trace):
        return "after_lost_writes"
    if any(lived[0] <= end and start <= lived[1] for start, end in windows):
        return "in_a_failover_window"
    if any(pid_of(str(h.detail["worker_id"])) in frozen for h in trace if "worker_id" in h.detail):
        return "by_a_woken_worker"
    return ""


def why_left(r: redis.Redis, key: str, frozen: set[int], since: float,
             windows: list[tuple[float, float]] = ()) -> dict[str, object]:
    """A key left without a TTL, with the journey of its request (a request's key) and the known fault that
    explains it, if any."""
    _, _, tagged = key.partition("{")
    request_id = tagged.partition("}")[0] if key.startswith(f"{NS}:") and KEYS.worker_of(key) is None else ""
    trace = hops(r, request_id) if request_id else []
    since_wall = time.time() - (time.monotonic() - since)
    return {"key": key, "journey": journey(trace, since_wall) if trace else "",
            "cause": cause_of(trace, frozen, lived_of(trace), windows) if request_id else ""}


def lived_of(trace: list[TraceEvent]) -> tuple[float, float]:
    """A trace's first and last hop on time.monotonic()'s clock."""
    offset = time.time() - time.monotonic()
    return (trace[0].at - offset, trace[-1].at - offset) if trace else (0.0, 0.0)


# One run.

def fault_free(url: str, options: Options, prompt: str) -> str:
    answer = httpx.post(f"{url}/generate", json=options.body(prompt), timeout=600)
    answer.raise_for_status()
    return answer.json()["text"]


def run(options: Options, log: Callable[[str], None] = print) -> dict[str, object]:
    """The soak; returns its report (verdicts under "verdicts")."""
    plan = schedule(options)
    report: dict[str, object] = {
        "engine": options.engine, "minutes": options.minutes, "seed": options.seed, "clients": options.clients,
        "tokens_per_request": options.tokens, "warmup_s": options.warmup_s,
        "stack": {"gateways": GATEWAYS, "workers": WORKERS, "schedulers": SCHEDULERS,
                  "redis": f"sentinel: a primary, {DATA_SERVERS - 1} replicas, {SENTINELS} sentinels (quorum 2), "
                           f"min-replicas-to-write {WRITE_REPLICAS}"},
        "settings": options.settings(), "network_delay_s": NETWORK_DELAY_S}
    log(f"nemesis: {len(plan)} faults over {options.minutes} min, seed {options.seed}, {options.clients} clients, "
        f"ENGINE={options.engine}")
    with nemesis_stack(options) as running:
        r = sync_client(running.redis_url, socket_timeout=10)
        with ThreadPoolExecutor(len(options.prompts())) as pool:  # the fault-free texts, all at once
            expected = dict(zip(options.prompts(), pool.map(lambda prompt: fault_free(running.url, options, prompt),
                                                            options.prompts()), strict=True))
        stop = threading.Event()
        clients = [Client(n, running.urls, options, stop) for n in range(options.clients)]
        for client in clients:
            client.thread.start()
        time.sleep(options.warmup_s)
        keys_before, lasting_before, rss_before = key_census(r), lasting(r), rss_of(running.stack)
        used_before = round(r.info("memory")["used_memory"] / (1 << 20), 1)
        nemesis = Nemesis(running, clients, plan)
        started = time.monotonic()
        nemesis.run(options.minutes * 60, log)
        faulty_s = time.monotonic() - started
        log(f"faults done after {faulty_s:.0f} s; stopping the load")
        stop.set()
        deadline = time.monotonic() + options.job_deadline_s + 60
        told = time.monotonic()
        while any(client.thread.is_alive() for client in clients) and time.monotonic() < deadline:
            nemesis.tick()  # a service the last faults took down comes back meanwhile
            time.sleep(0.1)
            if time.monotonic() - told > 15:
                told = time.monotonic()
                log(f"waiting for {sum(c.thread.is_alive() for c in clients)} clients to end their streams")
        hung = [client.number for client in clients if client.thread.is_alive()]
        log(f"load stopped ({len(hung)} clients hung); waiting for every service to serve again")
        wait_until(nemesis.whole, options.settle_s, "every service back and serving", 0.5)
        settled_in = time.monotonic()
        left = settle(r, options.settle_s, log)
        settled_s = time.monotonic() - settled_in
        nemesis.tick()
        keys_after, lasting_after, rss_after = key_census(r), lasting(r), rss_of(running.stack)
        used_after = round(r.info("memory")["used_memory"] / (1 << 20), 1)
        jobs = [job for client in clients for job in client.jobs]
        windows = [(f.detail["at_monotonic"], f.detail["at_monotonic"] + SPLIT_S[f.fault]) for f in plan
                   if f.fault in SPLIT_S and "at_monotonic" in f.detail]
        new_lasting = sorted(lasting_after - lasting_before)
        # A shared key without a TTL is the stack's own (its streams, counters, sets); a request's or a gone
        # worker's is one left behind.
        left_behind = [key for key in new_lasting if not key.startswith(f"{{{NS}}}:")]
        behind = [why_left(r, key, nemesis.ever_frozen, started, windows) for key in left_behind]
        checked = check(jobs, expected, options.tokens, r, nemesis.ever_frozen, started, windows)
        restarts = Counter(running.stack.processes[i][0] for i in nemesis.supervisor.state
                           if nemesis.supervisor.state[i].started > started)
    counts = Counter(checked["counts"])
    growth = rss_growth(rss_before, rss_after)
    lives = rss_over_lives(nemesis.memory, 60.0)
    report |= {
        "faulty_phase_s": round(faulty_s, 1),
        "schedule": [fault.logged() for fault in plan],
        "faults_struck": dict(Counter(f.fault for f in plan if f.done_s is not None)),
        "counts": counts, "errors_by_code": checked["errors_by_code"], "examples": checked["examples"],
        "fault_to_next_token_s": next_token_times(jobs, plan),
        "held_after_settling": left, "settled_in_s": round(settled_s, 1),
        "keys_before": keys_before, "keys_after": keys_after, "new_keys_without_ttl": new_lasting,
        "keys_without_ttl": {"start": len(lasting_before), "end": len(lasting_after)},
        "left_behind": behind[:10],
        "rss": growth, "rss_growth_mb_max": max((g["growth_mb"] for g in growth), default=None),
        # Few processes live through every fault: each one's growth over its own life as well, where sampled for
        # at least a minute.
        "rss_over_lives": lives,
        "rss_over_lives_growth_mb_max": max((g["growth_mb"] for g in lives), default=None),
        "memory_bounds_mb": {service: memory_bound_mb(service, options.engine) for service in MEMORY_BOUND_MB},
        "memory_grew": grown(lives, options.engine),
        "redis_used_memory_mb": {"start": used_before, "end": used_after},
        "services_through_the_faulty_phase": len(growth), "client_errors": [e for c in clients for e in c.errors],
        "hung_clients": hung,
    }
    verdicts = {
        "lost": counts.get("lost", 0) + len(hung), "duplicated": counts.get("duplicated", 0),
        "run_twice": counts.get("run_twice", 0), "texts_unequal": counts.get("texts_unequal", 0),
        "unexpected_errors": counts.get("unexpected_errors", 0),
        "vanished_left_running": counts.get("vanished_left_running", 0),
        "keys_without_ttl_left": len(left_behind),
        "held_after_settling": holding(left),
        "client_errors": len(report["client_errors"]),
        "memory_grew": len(report["memory_grew"]),
    }
    for entry in behind:
        if entry["cause"]:
            counts[f"keys_without_ttl_left_{entry['cause']}"] += 1
    # Each verdict's share that a known fault of the services explains, and what no known fault explains.
    known = {name: {cause: counts.get(f"{name}_{cause}", 0) for cause in EXPLAINED if counts.get(f"{name}_{cause}")}
             for name in verdicts}
    report["verdicts_explained"] = {name: shares for name, shares in known.items() if shares}
    report["verdicts_unexplained"] = {name: value - sum(known[name].values()) for name, value in verdicts.items()}
    report["verdicts"] = verdicts | {"ok": not any(verdicts.values())}
    report["restarts_during_faulty_phase"] = dict(restarts)
    return report


def summary(report: dict) -> str:
    counts, verdicts = report["counts"], report["verdicts"]
    nt = report["fault_to_next_token_s"]["all_faults"]
    lines = [
        f"faults struck: {sum(report['faults_struck'].values())} {json.dumps(report['faults_struck'])}",
        f"jobs {counts.get('jobs', 0)}: completed {counts.get('jobs_completed', 0)}, vanished "
        f"{counts.get('jobs_vanished', 0)} (cancelled {counts.get('vanished_cancelled', 0)}, finished first "
        f"{counts.get('vanished_finished', 0)}), lost {counts.get('jobs_lost', 0)}; requests "
        f"{counts.get('requests', 0)}, resumed jobs {counts.get('jobs_resumed', 0)} ({counts.get('resumes', 0)} "
        f"resumes), migrated {counts.get('migrated', 0)}, errors {json.dumps(report['errors_by_code'])}",
        f"fault to next token: median {nt['median']} s, p90 {nt['p90']} s, max {nt['max']} s over {nt['n']}",
        f"held after settling: {json.dumps(report['held_after_settling'])}",
        f"new keys without a TTL: {report['new_keys_without_ttl']}",
        "rss growth (MB): " + ", ".join(f"{g['service']} {g['pid']} {g['start_mb']}->{g['end_mb']}"
                                         for g in report["rss"]),
        f"rss growth over each life (MB): at most {report['rss_over_lives_growth_mb_max']} over "
        f"{len(report['rss_over_lives'])} lives; past its bound {json.dumps(report['memory_bounds_mb'])}: "
        f"{json.dumps(report['memory_grew'])}",
        f"verdicts: {json.dumps(verdicts)}",
        f"explained by the known faults: {json.dumps(report['verdicts_explained'])}",
        f"unexplained: {json.dumps({k: v for k, v in report['verdicts_unexplained'].items() if v})}",
    ]
    if report["examples"]:
        lines.append(f"examples: {json.dumps(report['examples'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="the faulty phase")
    parser.add_argument("--engine", choices=("sim", "hf"), default="sim")
    parser.add_argument("--seed", type=int, default=45)
    parser.add_argument("--clients", type=int, default=0, help="default: 12 (sim), 4 (hf)")
    parser.add_argument("--tokens", type=int, default=0, help="max_tokens of each request; default 200 (sim), 32 (hf)")
    parser.add_argument("--out", type=Path, help="default: bench/results/nemesis[-hf]-<host kind>.json")
    parser.add_argument("--service-log", type=Path, default=Path("/tmp/nemesis-services.log"),
                        help="where the services' own output goes")
    args = parser.parse_args()
    started = provenance()
    # The services inherit this process's stdout and stderr: theirs go to the log, this script's to the terminal.
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    with open(args.service_log, "ab") as services:
        os.dup2(services.fileno(), 1)
        os.dup2(services.fileno(), 2)
    sys.stdout = sys.stderr = terminal

    def say(line: str) -> None:
        print(line, file=terminal, flush=True)

    options = Options(args.minutes, args.engine, args.seed, args.clients, args.tokens, out=args.out)
    report = run(options, say)
    say(summary(report))
    benchmark = "nemesis" if args.engine == "sim" else "nemesis-hf"
    say(f"wrote {write_results(benchmark, started, report, args.out)}")
    sys.exit(0 if report["verdicts"]["ok"] else 1)


if __name__ == "__main__":
    main()
