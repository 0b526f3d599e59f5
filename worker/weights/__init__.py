"""The own engine's model paths: what a model's linear layers, and the layer glue around them, run on. One module
per weight format, each saying what it runs; `choose` and `apply` here are the one place that picks the path,
from the model's files, the device and the settings (WORKER_QUANT, WORKER_NATIVE).

- gguf (blocks.py, blocks.cpp): the GGUF file's own Q4_1 / Q8_0 blocks, each token's activations in 8 bits a
  block of 32. Chosen by `auto` on an x86 CPU for a local GGUF file of those block types, with the kernels loaded.
- int8 (quant.py, rotation.py): 8-bit weights per output channel after a Hadamard rotation, 8-bit activations per
  row. Chosen by `auto` on a CPU for any other model, or where the blocks cannot serve; or by `int8`.
- The layer glue of both, rotary heads and attention: compiled (native.py, native.cpp; AVX-512, AVX2 and plain
  builds) wherever a C++ compiler builds them (`WORKER_NATIVE=auto`); else, for int8, the same arithmetic run by
  TorchScript (scripted.py), which is what serves where no compiler exists.
- none: transformers' own forward in float32 (bfloat16 on a GPU). On a GPU, where torch has no int8 kernels
  (fbgemm), or by `none`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch
from transformers import PreTrainedModel

from common.settings import Settings
from worker.weights import blocks, native, quant

log = logging.getLogger("worker")

PATHS = ("auto", "gguf", "int8", "none")


def choose(setting: str, device: torch.device, gguf_file: str | None, int8_supported: bool) -> str:
    """The path a model takes, before anything is loaded (so that a bad value fails at once). `auto` on a CPU is
    the GGUF file's own blocks where the model comes from one (they may still fall back: `apply`), else int8 where
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


def apply(model: PreTrainedModel, path: str, settings: Settings, gguf_file: str | None) -> str:
    """Put the model on `path` (choose's answer); returns the path it took. Where `auto` chose the blocks and they
    cannot serve (no kernels, a file of other block types), int8, with a warning that says why."""
    kernels = path != "none" and native.load(settings.worker_native)
    if path == "gguf":
        path = _take_blocks(model, settings, kernels, gguf_file)
    if path == "int8":
        quant.quantize_int8(model, native=kernels)
    if path != "none":
        _return_freed_memory()
    return path


def _take_blocks(model: PreTrainedModel, settings: Settings, kernels: bool, gguf_file: str | None) -> str:
    try:
        if not kernels:
            raise blocks.BlockError(f"the compiled kernels are not loaded (WORKER_NATIVE={settings.worker_native})")
        blocks.quantize_blocks(model, gguf_file)
    except blocks.BlockError as error:
        if settings.worker_quant == "gguf":
            raise ValueError(f"WORKER_QUANT=gguf: {error}") from error
        fallback = "int8" if quant.supported() else "none"
        log.warning("the GGUF file's own blocks cannot serve", extra={"error": str(error), "quant": fallback})
        return fallback
    return "gguf"


def _return_freed_memory() -> None:
    """Hand the heap pages of the freed float weights back to the system: glibc keeps them otherwise, and the
    worker would stay at the float model's size."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)
