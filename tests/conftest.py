"""Fixtures that run the real parts: a private redis-server, the services as
separate processes, the real default model (in-process, loaded once per session), and the
helpers every test file shares: a stack of ENGINE=sim workers, an engine stepped to the end."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import pytest
import redis

from common.clients import sync_client
from common.keys import Keys
from common.protocol import SamplingParams
from common.settings import Settings
from harness.stacks import PrivateStack, private_stack
from harness.stacks import pid_of as pid_of  # the tests take it from here
from llmserve.launcher import Stack, start_redis
from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for

if TYPE_CHECKING:  # torch, the model and the SDKs load only where a test asks for them
    import openai
    from transformers import PreTrainedTokenizerBase

    from worker.core import StepOutput
    from worker.own.engine import Engine
    from worker.own.model import LoadedModel


# Modules of vLLM in-process tests: `make test` runs them with .venv-vllm's pytest; the main venv leaves them out
# rather than counting them as skips.
VLLM_HERE = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if VLLM_HERE else ["test_vllm_config.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cases that can never run in this interpreter are deselected, not skipped, so that a green run shows no skip
    and a new one stands out: the engine contract's vLLM cases without vLLM (the .venv-vllm run takes them), and
    its cases that need a model (`model_feature`) on ENGINE=sim."""
    keep, drop = [], []
    for item in items:
        engine = item.callspec.params.get("subject") if hasattr(item, "callspec") else None
        never = (engine == "vllm" and not VLLM_HERE) or (engine == "sim" and item.get_closest_marker("model_feature"))
        (drop if never else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@dataclass
class RunningStack:
    url: str
    redis: redis.Redis
    keys: Keys
    stack: Stack

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def extra(self, services: list[str], **settings: str) -> tuple[str, Stack]:
        """More services of this stack's Redis with other settings (no model load unless a worker);
        returns the URL of their gateway and the Stack to stop."""
        port = free_port()
        extra = Stack({**self.stack.env, "GATEWAY_PORT": str(port), **settings})
        for name in services:
            extra.spawn(name)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: responds(f"{url}/health"), 30, "the extra gateway")
        return url, extra


def trace(url: str, request_id: str, headers: dict | None = None) -> list[dict]:
    """The hops of a request's journey across the services, in order (GET /v1/requests/{id}/trace)."""
    response = httpx.get(f"{url}/v1/requests/{request_id}/trace", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["events"]


def workers_of(url: str, request_id: str, hop: str = "dispatched", headers: dict | None = None) -> list[str]:
    """The workers of the request's trace's `hop`s, in order: those it was dispatched to, or (hop "finished") the
    one it finished on."""
    return [e["detail"]["worker_id"] for e in trace(url, request_id, headers) if e["hop"] == hop]


def dispatched_to(url: str, request_id: str, headers: dict | None = None) -> list[str]:
    """The workers the request was dispatched to, in order, from its trace."""
    return workers_of(url, request_id, "dispatched", headers)


@contextmanager
def redis_server(password: str = "") -> Iterator[str]:
    """A redis-server of the test's own on a free port, started as every stack starts its own; yields its URL."""
    port = free_port()
    url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
    process = start_redis(url, Settings.redis_maxmemory, *(("--requirepass", password) if password else ()))
    try:
        yield url
    finally:
        process.terminate()
        process.wait()


def native_kernels() -> None:
    """For a module of tests of the compiled kernels: skipped only on a host without what the README says they
    need (a C++ compiler and ninja); there, a build that fails is an error of the whole module, not a skip."""
    from torch.utils import cpp_extension

    from worker.weights import native

    if not (shutil.which(cpp_extension.get_cxx_compiler()) and cpp_extension.is_ninja_available()):
        pytest.skip("no C++ compiler or ninja on this host: the compiled kernels cannot build", allow_module_level=True)
    native.load("on")  # raises the build's error


def responds(url: str) -> bool:
    try:
        return httpx.get(url).status_code < 500
    except httpx.HTTPError:
        return False


STACK_WORKERS = 2


@pytest.fixture(scope="session")
def stack() -> Iterator[RunningStack]:
    """Gateway, scheduler and two workers, each its own process, on the real model."""
    settings = {"NAMESPACE": "test", "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
                "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port())}
    with private_stack(STACK_WORKERS, **settings) as running:
        yield RunningStack(running.url, sync_client(running.redis_url), Keys("test"), running.stack)


def openai_client(url: str, **options: object) -> openai.OpenAI:
    """The official SDK on a gateway's /v1, with no retries of its own: a failure shows where it happened."""
    import openai

    return openai.OpenAI(**{"base_url": f"{url}/v1", "api_key": "unused", "max_retries": 0, "timeout": 180,
                            **options})


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> openai.OpenAI:
    """The OpenAI client on the module's stack (a module may give its own `stack`)."""
    return openai_client(stack.url)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer, from where a worker takes it."""
    from transformers import AutoTokenizer

    from worker.prompts import source

    path, extra = source(Settings())
    return AutoTokenizer.from_pretrained(path, **extra)


# What a sim stack runs with unless a test says otherwise: its model named "sim" (the name its requests give and
# its workers answer to), steps of 20 ms, a worker known lost within 2 s.
SIM_SETTINGS = {"ENGINE": "sim", "MODEL": "sim", "SIM_STEP_MS": "20", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
                "LOG_LEVEL": "WARNING"}


@contextmanager
def sim_stack(workers: int = 1, gateways: int = 1, redis: str = "single", **settings: str) -> Iterator[PrivateStack]:
    """A private stack of ENGINE=sim workers (no model: it starts in seconds), SIM_SETTINGS under `settings`, its
    services' metrics on free ports."""
    merged = {**SIM_SETTINGS, "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port()),
              **settings}
    with private_stack(workers, gateways, redis, **merged) as running:
        yield running


def _load(**settings: object) -> LoadedModel:
    from worker.own.model import load_model

    return load_model(Settings(worker_threads=1, **settings))


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    """The real default model in-process as a worker loads it (WORKER_QUANT=auto: the GGUF file's blocks where the
    kernels build), once for every test file that steps an engine on it. Tests only read it."""
    return _load()


@pytest.fixture(scope="session")
def int8_loaded() -> LoadedModel:
    """The real default model with WORKER_QUANT=int8."""
    return _load(worker_quant="int8")


@pytest.fixture(scope="session")
def float_loaded() -> LoadedModel:
    """The real default model in float32 (WORKER_QUANT=none)."""
    return _load(worker_quant="none")


Arrival = tuple[str, list[int], SamplingParams] | tuple[str, list[int], SamplingParams, list[int] | None]


def run_engine(engine: Engine, arrivals: dict[int, list[Arrival]]) -> dict[str, list[StepOutput]]:
    """Step `engine` until it has no work left, adding each (request id, prompt ids, params[, resume]) at its step;
    returns each request's outputs in order."""
    outputs: dict[str, list[StepOutput]] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in arrivals):
        for request_id, ids, params, *resume in arrivals.get(step, []):
            engine.add(request_id, ids, params, *resume)
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
    return outputs
