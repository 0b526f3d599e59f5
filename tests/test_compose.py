"""docker-compose.yml and the local launcher must start the same services with the
same commands and settings (no Docker engine here, so this is the check)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.settings import Settings, env_names
from llmserve.launcher import SERVICE_COMMANDS

ROOT = Path(__file__).resolve().parent.parent
# Inside compose these two point at the compose network instead of the host.
COMPOSE_ONLY_DEFAULTS = {"REDIS_URL": "redis://redis:6379/0"}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_runs_the_launcher_services_with_the_same_commands() -> None:
    services = compose()["services"]
    assert set(services) == {"redis", *SERVICE_COMMANDS}
    for name, command in SERVICE_COMMANDS.items():
        assert services[name]["command"] == command, name


def test_every_service_gets_every_setting_with_the_launcher_default() -> None:
    defaults = {field.upper(): str(value) for field, value in vars(Settings()).items()}
    for name in SERVICE_COMMANDS:
        environment = compose()["services"][name]["environment"]
        assert set(environment) == set(env_names()), name
        for key, value in environment.items():
            match = re.fullmatch(r"\$\{(\w+):-(.*)\}", value)
            assert match and match.group(1) == key, f"{name}: {key} must be ${{{key}:-default}}"
            assert match.group(2) == COMPOSE_ONLY_DEFAULTS.get(key, defaults[key]), f"{name}: {key}"


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
