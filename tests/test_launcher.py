"""`llmserve up`, as `make run` starts it: an embedded Redis when none answers, every
service as its own process, Ctrl-C stopping all of them, and nothing started on a bad
setting. Supervision (restarts, kill -9 of the launcher) is in test_supervision.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from llmserve.launcher import redis_reachable
from llmserve.processes import free_port
from llmserve.processes import wait_until as wait_for

LLMSERVE = Path(sys.executable).with_name("llmserve")


def test_up_starts_redis_and_every_service_and_ctrl_c_stops_them() -> None:
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    assert not redis_reachable(redis_url)
    env = dict(os.environ, REDIS_URL=redis_url, GATEWAY_PORT=str(port), GATEWAY_HOST="127.0.0.1",
               WORKER_THREADS="1", SCHEDULER_METRICS_PORT=str(free_port()), WORKER_METRICS_PORT=str(free_port()),
               LAUNCHER_METRICS_PORT=str(free_port()))
    # A session of its own, so that Ctrl-C can be sent to its process group as a terminal does.
    launcher = subprocess.Popen([str(LLMSERVE), "up", "--workers", "1"], env=env, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert "curl -N" in launcher.stdout.readline() + launcher.stdout.readline()

        def serving() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").json()["workers"] == 1
            except httpx.HTTPError:
                return False

        wait_for(serving, 180, "the stack behind llmserve up", 0.5)
        assert redis_reachable(redis_url)
        children = psutil.Process(launcher.pid).children()
        services = sorted(c.cmdline()[-1] for c in children if c.name() != "redis-server")
        assert services == ["gateway", "scheduler", "worker"]
        assert any(c.name() == "redis-server" for c in children)
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert answer.status_code == 200
        os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C sends, to the foreground process group
        assert launcher.wait(60) == 0
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
        assert not redis_reachable(redis_url)
    finally:
        # A failed assertion must not leave the stack running: stop it the way Ctrl-C does, else kill it all.
        if launcher.poll() is None:
            stragglers = psutil.Process(launcher.pid).children(recursive=True)
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(60)
            except subprocess.TimeoutExpired:
                for process in [*stragglers, psutil.Process(launcher.pid)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()


def test_a_bad_setting_is_named_and_nothing_starts() -> None:
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    env = dict(os.environ, REDIS_URL=redis_url, WORKER_SLOTS="abc", GATEWAY_PORT=str(free_port()))
    started = time.monotonic()
    done = subprocess.run([str(LLMSERVE), "up", "--workers", "1"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "WORKER_SLOTS" in done.stderr and "curl" not in done.stdout
    assert not redis_reachable(redis_url)
    assert time.monotonic() - started < 30  # it did not wait for any service


def test_an_embedded_redis_ends_with_the_process_that_started_it() -> None:
    """private_stack's Redis too: a test run killed by kill -9 leaves no redis-server behind."""
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    script = ("import sys, time\nfrom llmserve.launcher import start_redis\n"
              f"print(start_redis({redis_url!r}).pid, flush=True)\ntime.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    redis_pid = int(parent.stdout.readline() or 0)
    try:
        assert redis_pid and redis_reachable(redis_url)
        parent.kill()
        parent.wait()
        wait_for(lambda: not redis_reachable(redis_url), 10, "the orphaned redis-server to exit")
    finally:
        parent.kill()
        if redis_pid:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(redis_pid).kill()
