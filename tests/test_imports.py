"""The services' modules import one way: no module reaches itself through its imports. A circle works until someone
imports its modules in another order, and then fails at import (a partially initialised module)."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("common", "gateway", "scheduler", "worker", "llmserve")
PACKAGES = (*SHIPPED, "harness")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """What a module imports of ours at any depth of its code, with the packages whose __init__ each import runs."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
    taken = set()
    for name in named:
        parts = name.split(".")
        taken.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return taken & known


def graph() -> dict[str, set[str]]:
    found = modules()
    edges = {}
    for name, path in found.items():
        # A module's own packages are initialised before it, so importing them is no circle.
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges[name] = imports(path, set(found)) - own - {name}
    return edges


def test_no_module_reaches_itself_through_its_imports():
    try:
        order = list(graphlib.TopologicalSorter(graph()).static_order())
    except graphlib.CycleError as error:
        pytest.fail(f"an import circle: {' -> '.join(error.args[1])}")
    assert len(order) >= 60  # every service's modules were read


# Lower rooms import nothing of the rooms above them: the model paths and kernels serve the own engine and know
# nothing of it; the text side and the engine seam serve every engine. What is installed needs nothing of the
# harness of tests and benchmarks, which is not.
# Engines sit side by side: what two of them share lives below both (worker.sampling, worker.grammar, worker.output),
# and the wire protocol and the bus in common serve every service and know none of them.
ENGINES = ("worker.own", "worker.llamacpp", "worker.vllm")
BELOW = {**{package: ("harness",) for package in SHIPPED},
         "common": ("gateway", "scheduler", "worker", "llmserve", "harness"),
         "worker.weights": (*ENGINES, "worker.main"),
         "worker.output": ENGINES,
         "worker.core": ENGINES,
         "worker.sampling": ENGINES,
         "worker.grammar": ENGINES,
         "worker.llamacpp": ("worker.own", "worker.vllm"),
         "worker.vllm": ("worker.own", "worker.llamacpp")}


def within(module: str, rooms: tuple[str, ...]) -> bool:
    """Whether a module is one of these rooms or inside one (worker.ownership is not inside worker.own)."""
    return any(module == room or module.startswith(f"{room}.") for room in rooms)


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {target}" for module, targets in edges.items() for target in targets
                  for room, above in BELOW.items() if within(module, (room,)) and within(target, above))


def test_no_arrow_runs_back_up():
    assert upward(graph()) == []


def test_the_check_sees_an_arrow_back_up():
    edges = graph()
    edges["worker.weights.blocks"].add("worker.own.cache")  # the arrow this check was written after
    assert upward(edges) == ["worker.weights.blocks -> worker.own.cache"]


def test_the_check_sees_an_engine_reach_sideways():
    edges = graph()
    edges["worker.llamacpp.engine"].add("worker.own.sampling")  # the arrow the shared sampler replaced
    edges["common.streams"].add("gateway.bus")
    assert upward(edges) == ["common.streams -> gateway.bus", "worker.llamacpp.engine -> worker.own.sampling"]


def test_the_check_sees_a_circle():
    edges = graph()
    edges["worker.weights.quant"].add("worker.own.cache")  # the circle this check was written after
    edges["worker.own.cache"].add("worker.weights.quant")
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(edges).static_order())


@pytest.mark.parametrize("first", ["worker.weights.quant", "worker.own.cache", "worker.weights.paths",
                                   "scheduler.compat_metrics", "harness.topology", "common.settings"])
def test_a_module_imports_first_in_a_fresh_process(first):
    """Each module that was once in a circle imports on its own, before anything else of ours."""
    done = subprocess.run([sys.executable, "-c", f"import {first}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
