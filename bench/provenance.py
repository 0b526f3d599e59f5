"""Where and from what a benchmark's figures came, written into each results file: the host, its CPU and the
instruction sets that decide which kernels run, any GPU, the commit (and whether the tree had changes), the
command line, the load when it started, and the time.

Results are data: bench/results/<benchmark>-<host kind>.json holds the current run of one benchmark on one kind
of host, and a new run on a host of that kind replaces it (earlier runs are in git's history). bench/tables.py
renders the documentation's tables from these files."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# The flags of /proc/cpuinfo that the CPU kernels (ours and the peers') choose between.
# Settings in the environment that change which kernels run: a run's command names those it had.
KERNEL_SETTINGS = ("ENGINE", "WORKER_QUANT", "WORKER_NATIVE", "WORKER_ISA", "ATEN_CPU_CAPABILITY")
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile")


def provenance() -> dict[str, object]:
    cpu, flags = _cpu()
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "isa": [flag for flag in ISA_FLAGS if flag in flags], "gpu": _gpu(), "commit": _git("rev-parse", "HEAD"),
            "dirty_tree": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "command": " ".join([*_kernel_settings(), Path(sys.executable).name, *sys.argv]),
            "load_average_at_start": os.getloadavg(),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def host_kind(record: dict[str, object]) -> str:
    """The kind of host a figure holds for, by what decides which kernels run (the README keeps one table per
    kind): gpu where one is visible (the worker runs on it by default), else avx512 or avx2 by the x86 CPU's."""
    if record.get("gpu"):
        return "gpu"
    return "avx512" if "avx512f" in record.get("isa", []) else "avx2"  # type: ignore[operator]


def results_path(benchmark: str, started: dict[str, object]) -> Path:
    """Where a run of `benchmark` on this host goes: one file per benchmark and host kind."""
    return RESULTS / f"{benchmark}-{host_kind(started)}.json"


def write_results(benchmark: str, started: dict[str, object], result: dict[str, object],
                  out: Path | str | None = None) -> Path:
    """Writes one run, with the provenance taken as it started, to `out` or to its benchmark's file."""
    path = Path(out) if out else results_path(benchmark, started)
    record = {"benchmark": benchmark, "host_kind": host_kind(started), "provenance": started, **result}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def update_results(benchmark: str, started: dict[str, object], parts: dict[str, object],
                   out: Path | str | None = None) -> Path:
    """For a benchmark run in parts: replaces the parts run now and keeps the others, naming in `provenance_of`
    the run (commit, time, command) each part comes from; the file's own provenance is the latest run's."""
    path = Path(out) if out else results_path(benchmark, started)
    previous = json.loads(path.read_text()) if path.exists() else {}
    ran = {part: {key: started[key] for key in ("commit", "at", "command")} for part in parts}
    record = {**previous, "benchmark": benchmark, "host_kind": host_kind(started), "provenance": started, **parts,
              "provenance_of": {**previous.get("provenance_of", {}), **ran}}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _kernel_settings() -> list[str]:
    return [f"{name}={os.environ[name]}" for name in KERNEL_SETTINGS if os.environ.get(name)]


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
