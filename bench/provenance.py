"""Where and from what a benchmark's figures came, written into each results file: the host, its CPU and the
instruction sets that decide which kernels run, any GPU, the commit (and whether the tree had changes), the
command line, the load when it started, and the time."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The flags of /proc/cpuinfo that the CPU kernels (ours and the peers') choose between.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile")


def provenance() -> dict[str, object]:
    cpu, flags = _cpu()
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "isa": [flag for flag in ISA_FLAGS if flag in flags], "gpu": _gpu(), "commit": _git("rev-parse", "HEAD"),
            "dirty_tree": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "load_average_at_start": os.getloadavg(),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def host_kind(record: dict[str, object]) -> str:
    """avx512 or avx2: the kind of x86 host a figure holds for (the README keeps one table per kind)."""
    return "avx512" if "avx512f" in record.get("isa", []) else "avx2"  # type: ignore[operator]


def _cpu() -> tuple[str, set[str]]:
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return platform.processor(), set()
    name, flags = platform.processor(), set()
    for line in info.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return name, flags


def _gpu() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return done.stdout.strip()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
