"""Drain figures (issue 11): how long a worker told to stop (SIGTERM) takes to exit while it runs streams,
handing them to the other worker (DRAIN_MODE=auto, the default where another worker has room) against
finishing them in place (DRAIN_MODE=finish); and what its clients see: streams completed, lost, texts equal
to a run without the stop, and the pause from the signal to each stream's next token. Two workers, greedy
streams of the real model (or ENGINE=sim with --engine sim), one stack per mode."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.chaos as chaos  # noqa: E402
from bench.provenance import provenance, write_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, object]:
    settings = {"NAMESPACE": "chaos", "WORKER_THREADS": "1", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2",
                "LOG_LEVEL": "WARNING", "DRAIN_MODE": mode, "ENGINE": args.engine, "DRAIN_TIMEOUT": "120"}
    with private_stack(2, **settings) as running:
        prompts = [chaos.PROMPTS[i % len(chaos.PROMPTS)] for i in range(args.streams)]
        expected = {p: httpx.post(f"{running.url}/generate", json=chaos.body(p), timeout=600).json()["text"]
                    for p in set(prompts)}
        signalled: list[float] = []
        exited: list[float] = []

        def stop_busiest(fault_at: list[float]) -> None:
            pid = chaos.busiest_worker(running)
            process = next(p for _, p in running.stack.processes if p.pid == pid)
            os.kill(pid, signal.SIGTERM)
            fault_at.append(time.monotonic())
            signalled.append(fault_at[-1])
            threading.Thread(target=lambda: (process.wait(600), exited.append(time.monotonic())), daemon=True).start()

        report = asyncio.run(chaos.scenario(running, stop_busiest, expected, args.streams))
        chaos.wait_until(lambda: bool(exited), 600, "the stopped worker to exit")
    return {"drain_mode": mode, "worker_exit_s": exited[0] - signalled[0], **report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=160, help="tokens per stream (ignore_eos)")
    parser.add_argument("--engine", choices=["hf", "sim"], default="hf")
    args = parser.parse_args()
    chaos.TOKENS = args.tokens  # the streams' body() reads it
    provenance_at_start = provenance()
    report: dict[str, object] = {"streams": args.streams, "tokens_per_stream": args.tokens, "engine": args.engine}
    for mode in ("auto", "finish"):
        started = time.monotonic()
        result = run_mode(mode, args)
        print(mode, json.dumps(result), f"({time.monotonic() - started:.0f} s)", flush=True)
        report[mode] = result
    write_results(f"drain_{args.engine}", provenance_at_start, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
