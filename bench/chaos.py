"""Fault figures (issue 4): for each fault, greedy streams in flight on a real stack
(two workers), then: completed, migrated, failed with a clear error, lost (must be
0), duplicated token indexes seen by a client (must be 0), texts equal to a run
without the fault, and the time from the fault to each stream's next token."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.keys import Keys  # noqa: E402
from harness.sse import aparse  # noqa: E402
from harness.stacks import PrivateStack, pid_of, private_stack  # noqa: E402
from llmserve.processes import wait_until  # noqa: E402

KEYS = Keys("chaos")
TOKENS = 48
PROMPTS = [f"Write a long essay about {topic}." for topic in
           ("ships", "bread", "rivers", "clocks", "bees", "glass", "trains", "paper")]


def body(prompt: str) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


async def one_stream(client: httpx.AsyncClient, prompt: str, fault_at: list[float]) -> dict[str, object]:
    indexes, text, outcome, gap, last = [], "", "lost", None, None
    try:
        async with client.stream("POST", "/generate_stream", json=body(prompt)) as response:
            if response.status_code != 200:
                return {"outcome": "error", "indexes": [], "text": "", "gap": None}
            async for event in aparse(response.aiter_lines()):
                if event.event == "error":
                    outcome = "error"
                data = event.data
                if "index" in data:
                    now = time.monotonic()
                    if fault_at and gap is None and last is not None and last < fault_at[0] <= now:
                        gap = now - fault_at[0]
                    last = now
                    indexes.append(data["index"])
                    text += data["token"]
                elif "finish_reason" in data:
                    outcome = "completed"
    except httpx.HTTPError:
        outcome = "lost"
    return {"outcome": outcome, "indexes": indexes, "text": text, "gap": gap}


async def scenario(running: PrivateStack, fault: Callable[[list[float]], None], expected: dict[str, str],
                   streams: int, extra_after_fault: int = 0) -> dict[str, object]:
    fault_at: list[float] = []
    r = redis.Redis.from_url(running.redis_url)
    migrated_before = _migrations(r)
    async with httpx.AsyncClient(base_url=running.url, timeout=300) as client:
        tasks = [asyncio.create_task(one_stream(client, PROMPTS[i % len(PROMPTS)], fault_at)) for i in range(streams)]
        await asyncio.sleep(3)  # all streams are running by now
        # The fault appends the moment it strikes to fault_at.
        await asyncio.get_running_loop().run_in_executor(None, fault, fault_at)
        later = [asyncio.create_task(one_stream(client, PROMPTS[i % len(PROMPTS)], []))
                 for i in range(extra_after_fault)]
        results = await asyncio.gather(*tasks, *later)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)] + \
              [PROMPTS[i % len(PROMPTS)] for i in range(extra_after_fault)]
    gaps = [res["gap"] for res in results if res["gap"] is not None]
    return {
        "in_flight": streams, "arrived_after_fault": extra_after_fault,
        "completed": sum(res["outcome"] == "completed" for res in results),
        "failed_with_error": sum(res["outcome"] == "error" for res in results),
        "lost": sum(res["outcome"] == "lost" for res in results),
        # Redis forgets the traces when it restarts, hence the floor at 0.
        "migrated": max(_migrations(r) - migrated_before, 0),
        "duplicated_tokens": sum(len(res["indexes"]) - len(set(res["indexes"])) for res in results),
        "text_equal_to_fault_free": sum(res["outcome"] == "completed" and res["text"] == expected[p]
                                        for res, p in zip(results, prompts, strict=True)),
        "fault_to_next_token_s_median": statistics.median(gaps) if gaps else None,
        "fault_to_next_token_s_max": max(gaps) if gaps else None,
    }


def _migrations(r: redis.Redis) -> int:
    """Requests re-queued by the scheduler, counted from the traces it stamps."""
    count = 0
    for key in r.scan_iter(match=KEYS.trace("*")):
        count += sum(b"migrated" in item for item in r.lrange(key, 0, -1))
    return count


def busiest_worker(running: PrivateStack) -> int:
    r = redis.Redis.from_url(running.redis_url)
    ids = list(r.smembers(KEYS.workers))
    return pid_of(max(ids, key=lambda w: r.hlen(KEYS.assigned(w.decode()))))


def restore(running: PrivateStack, stopped_pid: int | None = None) -> None:
    """Back to two workers: wait for a worker told to stop to leave, then replace what is gone."""
    if stopped_pid is not None:
        process = next(p for _, p in running.stack.processes if p.pid == stopped_pid)
        process.wait(60)
    live = sum(1 for name, p in running.stack.processes if name == "worker" and p.poll() is None)
    for _ in range(2 - live):
        running.stack.spawn("worker")
    wait_until(lambda: httpx.get(f"{running.url}/health").json().get("workers") == 2, 180, "workers", 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=6)
    args = parser.parse_args()
    settings = {"NAMESPACE": "chaos", "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
                "LOG_LEVEL": "WARNING"}
    started = provenance()
    report: dict[str, object] = {"streams": args.streams, "tokens_per_stream": TOKENS}
    with private_stack(2, **settings) as running:
        expected = {p: httpx.post(f"{running.url}/generate", json=body(p), timeout=300).json()["text"]
                    for p in PROMPTS[:args.streams]}

        def scheduler() -> object:
            return next(p for name, p in running.stack.processes if name == "scheduler" and p.poll() is None)

        def restart_scheduler(fault_at: list[float]) -> None:
            scheduler().kill()
            fault_at.append(time.monotonic())
            time.sleep(2)
            running.stack.spawn("scheduler")

        def restart_redis(fault_at: list[float]) -> None:
            running.stop_redis()
            fault_at.append(time.monotonic())
            time.sleep(1)
            running.start_redis()

        stopped: list[int] = []

        def signal_busiest(signum: int, fault_at: list[float]) -> None:
            stopped.append(busiest_worker(running))
            os.kill(stopped[-1], signum)
            fault_at.append(time.monotonic())

        faults = {
            "worker_kill_9": lambda fault_at: signal_busiest(signal.SIGKILL, fault_at),
            "worker_sigterm_drain": lambda fault_at: signal_busiest(signal.SIGTERM, fault_at),
            "scheduler_kill_9_restart": restart_scheduler,
            "redis_restart": restart_redis,
        }
        for name, fault in faults.items():
            extra = args.streams if name == "scheduler_kill_9_restart" else 0
            report[name] = asyncio.run(scenario(running, fault, expected, args.streams, extra))
            print(name, json.dumps(report[name]), flush=True)
            restore(running, stopped.pop() if stopped else None)
    write_results("chaos", started, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
