"""`llmserve up`, as `make run` starts it: an embedded Redis when none answers, every
service as its own process, and Ctrl-C stopping all of them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from llmserve.launcher import free_port, redis_reachable
from llmserve.launcher import wait_until as wait_for


def test_up_starts_redis_and_every_service_and_ctrl_c_stops_them() -> None:
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    assert not redis_reachable(redis_url)
    env = dict(os.environ, REDIS_URL=redis_url, GATEWAY_PORT=str(port), GATEWAY_HOST="127.0.0.1",
               WORKER_THREADS="1", SCHEDULER_METRICS_PORT=str(free_port()), WORKER_METRICS_PORT=str(free_port()))
    llmserve = Path(sys.executable).with_name("llmserve")
    launcher = subprocess.Popen([str(llmserve), "up", "--workers", "1"], env=env, stdout=subprocess.PIPE, text=True)
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
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C sends
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
