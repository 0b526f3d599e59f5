"""The one place that picks a model's path (see the package's docstring for what each path runs): `choose` from
the setting, the device and the model's files, before anything loads; `load` loads the model on it."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.settings import WorkerSettings
from worker.weights import blocks, from_file, native, quant, rope

log = logging.getLogger("worker")

PATHS = ("auto", "gguf", "int8", "none")


def choose(setting: str, device: torch.device, gguf_file: str | None, int8_supported: bool) -> str:
    """The path a model takes, before anything is loaded (so that a bad value fails at once). `auto` on a CPU is
    the GGUF file's own blocks where the model comes from one (they may still fall back: `load`), else int8 where
    torch has its kernels, else none; on any other device, none."""
    if setting not in PATHS:
        raise ValueError(f"WORKER_QUANT must be auto, gguf, int8 or none, not {setting!r}")
    if setting in ("gguf", "int8") and device.type != "cpu":
        raise ValueError(f"WORKER_QUANT={setting} runs on CPU only; the device is {device}: use none")
    if setting == "gguf" and not gguf_file:
        raise ValueError("WORKER_QUANT=gguf needs a local GGUF file: MODEL a folder and MODEL_FILE its .gguf")
    if setting != "auto":
        return setting
    if device.type != "cpu":
        return "none"
    return "gguf" if gguf_file else "int8" if int8_supported else "none"


def load(settings: WorkerSettings, chosen: str, source: str, extra: dict[str, str], device: torch.device,
         dtype: torch.dtype, gguf_file: str | None) -> tuple[PreTrainedModel, str]:
    """The model on its path (choose's answer), and the path it took. The GGUF blocks build the model from the file
    alone (worker/weights/from_file.py); every other path, and the blocks' fallback, loads transformers' model."""
    if chosen == "gguf":
        fallback = "int8" if quant.supported() else "none"
        model = _model_on_blocks(settings, source, extra, dtype, gguf_file, fallback)
        if model is not None:
            _return_freed_memory()
            return model, "gguf"
        chosen = fallback
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra).to(device).eval()
    if gguf_file:
        rope.take_file_factors(model, blocks.read_tensors(gguf_file))  # Llama 3's scaling (worker/weights/rope.py)
    return model, apply(model, chosen, settings)


def _model_on_blocks(settings: WorkerSettings, source: str, extra: dict[str, str], dtype: torch.dtype,
                     gguf_file: str | None, fallback: str) -> PreTrainedModel | None:
    """The model on the file's blocks; None where they cannot serve it and WORKER_QUANT=auto (a warning says why
    and names the `fallback` path), ValueError where WORKER_QUANT=gguf asked for them."""
    try:
        if not native.load(settings.worker_native):
            raise blocks.BlockError(f"the compiled kernels are not loaded (WORKER_NATIVE={settings.worker_native})")
        level = _log_kernels(settings)
        kept = blocks.agreeing_level(level)
        if kept < level:
            log.warning("the GGUF blocks' kernels disagree with their plain loops on this CPU: a lower level serves",
                        extra={"blocks_level": level, "kept": kept})
        if dtype != torch.float32:
            raise blocks.BlockError(f"the kernels take float32, and WORKER_DTYPE is {settings.worker_dtype}")
        return from_file.load(AutoConfig.from_pretrained(source, **extra), gguf_file)
    except blocks.BlockError as error:
        if settings.worker_quant == "gguf":
            raise ValueError(f"WORKER_QUANT=gguf: {error}") from error
        log.warning("the GGUF file's own blocks cannot serve", extra={"error": str(error), "quant": fallback})
        return None


def _log_kernels(settings: WorkerSettings) -> int:
    """The kernels capped at WORKER_ISA, logged; returns the blocks' level."""
    blocks_level, attention_level = native.cap(settings.worker_isa)
    log.info("kernels", extra={"isa": settings.worker_isa, "blocks_level": blocks_level,
                               "attention_level": attention_level})
    return blocks_level


def apply(model: PreTrainedModel, path: str, settings: WorkerSettings) -> str:
    """Put transformers' loaded model on `path` (int8 or none; the blocks build their own: `load`); returns the
    path it took."""
    kernels = path != "none" and native.load(settings.worker_native)
    if kernels:
        _log_kernels(settings)
    if path == "int8":
        path = _take_int8(model, settings, kernels)
    if path != "none":
        _return_freed_memory()
    return path


def _take_int8(model: PreTrainedModel, settings: WorkerSettings, kernels: bool) -> str:
    """int8, where its row-wise attention computes the model's; else float32 with a warning (`auto`), or a stop at
    start (`int8`): never a worker that starts and then fails every request."""
    why = quant.attention_unserved(model)
    if why is None:
        quant.quantize_int8(model, native=kernels)
        return "int8"
    if settings.worker_quant == "int8":
        raise ValueError(f"WORKER_QUANT=int8: {why}")
    log.warning("int8 cannot serve this model: float32", extra={
        "error": why, "hint": "ENGINE=llamacpp serves a GGUF file of any architecture llama.cpp loads"})
    return "none"


def _return_freed_memory() -> None:
    """Hand the heap pages of the freed float weights back to the system: glibc keeps them otherwise, and the
    worker would stay at the float model's size."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)
