"""The CPU worker's compiled kernels, registered as torch.ops.llmserve: native.cpp (the int8 layer's glue, the rotary
heads and attention over each row's own keys) and blocks.cpp (the GGUF blocks' products), beside this module.

Built on a worker's first start by torch's extension builder (a C++ compiler and ninja), into torch's cache
(~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), and loaded from there afterwards (the worker image builds
them while it is built). `WORKER_NATIVE=auto` (the default) uses them when they build and otherwise keeps the
int8 TorchScript layer (worker/weights/scripted.py), with a warning that says why; `on` stops the worker at start when
they do not build; `off` never builds them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("native.cpp", "blocks.cpp")]  # and native_math.h
NAME = "llmserve_native"
# No fused multiply-add: ATen's rounding (native.cpp; its block attention opts in). OpenMP: at::parallel_for is
# inline, and without it runs on one thread; the library it links is the one torch has loaded already (the same
# name), one pool of threads.
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
MODES = ("auto", "on", "off")

log = logging.getLogger("worker")


class NativeError(RuntimeError):
    pass


class _Ops:
    """torch.ops.llmserve's C++ functions themselves, each looked up once: a call through torch.ops (the packet or
    its overload) first runs a Python check for a tracer's fake arguments, and a decode step makes about 150
    calls (nothing here is traced)."""

    def __getattr__(self, name: str) -> Callable:
        function = getattr(torch.ops.llmserve, name).default._op
        setattr(self, name, function)  # found as a plain attribute from now on
        return function


ops = _Ops()


@dataclass
class _Build:
    loaded: bool
    error: str = ""


_build: _Build | None = None  # once per process


def load(mode: str = "auto") -> bool:
    """Whether torch.ops.llmserve's kernels are there, building or loading them on the first call."""
    global _build
    if mode not in MODES:
        raise ValueError(f"WORKER_NATIVE must be auto, on or off, not {mode!r}")
    if mode == "off":
        return False
    if _build is None:
        _build = _compile()
        if not _build.loaded:
            log.warning("native kernels unavailable; the int8 layer runs as TorchScript",
                        extra={"error": _build.error})
    if mode == "on" and not _build.loaded:
        raise NativeError(f"WORKER_NATIVE=on, but worker/weights/native.cpp did not build: {_build.error}")
    return _build.loaded


# WORKER_ISA's levels for both kernel files' isa setters: 0 plain, 1 AVX2 (with FMA), 2 AVX-512 (with VNNI for
# the blocks); each setter keeps what the CPU lacks out of reach.
ISA_LEVELS = {"plain": 0, "avx2": 1, "avx512": 2, "auto": 2}


def cap(isa: str) -> tuple[int, int]:
    """The loaded kernels at most at `isa` (WORKER_ISA); returns the levels the GGUF blocks and the attention now
    run at."""
    level = ISA_LEVELS[isa]
    return int(ops.block_isa(level)), int(ops.attention_isa(level))


def loaded() -> bool:
    """Whether the kernels are loaded (by an earlier load())."""
    return _build is not None and _build.loaded


def build_directory() -> Path:
    """Where the kernels are built: in torch's extension cache, one folder per Python, torch and accelerator."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path(root) / f"{NAME}-{build.replace('+', '-')}"


def _compile() -> _Build:
    try:
        from torch.utils import cpp_extension

        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        # One build at a time, under a lock the kernel drops with its holder. torch's own lock is a file that a
        # build killed mid-way (Ctrl-C on a first start) leaves behind, and every later start would wait on it for
        # ever: whoever holds ours may remove it.
        with open(folder / "llmserve.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS,
                               extra_include_paths=[str(SOURCES[0].parent)], build_directory=str(folder),
                               extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as error:  # no compiler, no ninja, an unwritable cache: the scripted layer serves
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
        causes = [line for line in lines if "not found" in line or "error:" in line]  # the compiler's own words
        return _Build(False, f"{type(error).__name__}: {(causes or lines)[-1][:300]}")
    return _Build(True)
