"""Settings by concern (common/settings.py): each service loads the concerns it reads, so its code may reach for
no other setting (a scan of its source), a bad value stops only the services that read it, and every variable
belongs to exactly one concern."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from common.errors import SettingsError
from common.settings import CONCERNS, SERVICES, GatewaySettings, SchedulerSettings, Settings, WorkerSettings, own_fields

ROOT = Path(__file__).resolve().parent.parent


def reached_for(package: str) -> dict[str, set[str]]:
    """Each setting or settings method the package's code reads off a name or attribute called `*settings*`, with
    the files it is read in."""
    known = {declared.name for declared in fields(Settings)} | {name for name in dir(Settings)
                                                                 if not name.startswith("_")}
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr not in known:
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if "settings" in name:
                found.setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_services_code_reads_only_the_concerns_it_loads(service: str) -> None:
    reads = reached_for(service)
    assert reads, "the scan found nothing: it no longer sees how the code reads its settings"
    missing = {name: where for name, where in reads.items() if not hasattr(SERVICES[service], name)}
    assert not missing, f"{service} reads settings of concerns it does not load: {missing}"


def test_common_code_reads_only_what_every_service_loads() -> None:
    missing = {name: where for name, where in reached_for("common").items()
               if not all(hasattr(settings, name) for settings in SERVICES.values())}
    assert not missing, missing


def test_every_variable_belongs_to_one_concern_and_every_concern_to_a_reader() -> None:
    declared = [field.name for concern in CONCERNS for field in own_fields(concern)]
    assert sorted(declared) == sorted(field.name for field in fields(Settings))
    assert len(declared) == len(set(declared))
    launcher_only = [concern for concern in CONCERNS
                     if not any(issubclass(settings, concern) for settings in SERVICES.values())]
    assert launcher_only == []


def test_a_bad_value_stops_only_the_services_that_read_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENGINE_ARGS", '--served-model-name "unclosed')
    assert GatewaySettings.from_env().gateway_port == 8000
    assert SchedulerSettings.from_env().poison_limit == 3
    for loads in (WorkerSettings, Settings):  # the worker, and the launcher before it starts anything
        with pytest.raises(SettingsError, match=r"^VLLM_ENGINE_ARGS="):
            loads.from_env()
    monkeypatch.setenv("KEY_RPM", "many")
    with pytest.raises(SettingsError, match=r"^KEY_RPM='many': expected int"):
        GatewaySettings.from_env()
    assert SchedulerSettings.from_env().scheduling_policy == "fair"


def test_a_gateway_has_no_engine_settings_to_reach_for() -> None:
    gateway = GatewaySettings()
    with pytest.raises(AttributeError):
        gateway.worker_quant  # noqa: B018
    assert not hasattr(SchedulerSettings(), "api_keys") and hasattr(WorkerSettings(), "resume_ttl")
