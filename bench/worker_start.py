"""Issue 6, target 7: how long a new worker takes from its process start to the first
token it serves (model load, registration, assignment and prefill included), and its
resident memory with the default model, idle after that token and after a full batch.

Redis, gateway and scheduler run already; the worker process is started at t0 and the
request is sent at once: it waits in the scheduler's queue until the worker registers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target, stream  # noqa: E402
from llmserve.loadgen.run import Level, run_level  # noqa: E402
from llmserve.loadgen.workload import Job, Lengths, make_jobs  # noqa: E402


def one_start(threads: int) -> dict[str, float]:
    with private_stack(0, WORKER_THREADS=str(threads), LOG_LEVEL="WARNING") as running:
        started = time.perf_counter()
        worker = psutil.Process(running.stack.spawn("worker").pid)
        target, sampling = Target(running.url, "native"), Sampling()
        first = asyncio.run(stream(target, Job("Hello, my name is", 1), sampling))
        rss_first = worker.memory_info().rss
        jobs = make_jobs(16, Lengths("fixed", 32), Lengths("fixed", 64), seed=3)
        asyncio.run(run_level(target, jobs, sampling, Level(16, None), show_progress=False))
        rss_batch = worker.memory_info().rss
    return {"to_first_token_s": first.token_times[0] - started,
            "rss_after_first_token_mb": rss_first / 2**20, "rss_after_16x64_mb": rss_batch / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    started = provenance()
    rounds = []
    for _ in range(args.rounds):
        rounds.append(one_start(args.threads))
        print(json.dumps(rounds[-1]), flush=True)
    result = {"rounds": rounds, **{f"median_{key}": statistics.median(r[key] for r in rounds) for key in rounds[0]}}
    write_results("worker_start", started, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
