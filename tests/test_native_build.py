"""worker/weights/native.py's build under a lock that dies with its holder: a build killed mid-way (Ctrl-C on a first
`make run`) leaves torch's own lock file behind, and a worker that starts afterwards must still load its
kernels, not wait on that file for ever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import native_kernels
from worker.weights import native

LOAD = "from worker.weights import native; print(native.load('on'))"


@pytest.fixture(scope="module")
def built() -> Path:
    native_kernels()
    return native.build_directory()


def test_a_stale_lock_from_a_killed_build_does_not_hold_up_the_next_start(built: Path, tmp_path: Path) -> None:
    root = tmp_path / "extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    where = "from worker.weights import native; print(native.build_directory())"
    folder = Path(subprocess.run([sys.executable, "-c", where], env=env, capture_output=True, text=True,
                                 check=True).stdout.strip())
    shutil.copytree(built, folder)  # built already, as after a first start: loading it takes seconds
    (folder / "lock").write_text("")  # what a build killed mid-way leaves
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("True"), done.stderr[-2000:]
    assert not (folder / "lock").exists()
