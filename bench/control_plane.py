"""Issue 6, targets 5 and 6: the control plane (gateway, Redis, scheduler, fan-out)
measured with ENGINE=sim workers, whose step takes a fixed time and needs no model.

fan-out: one gateway, >= 1,000 concurrent SSE streams; output tokens/s, the
    inter-token latency the streams see against the engine's own step time, and
    the gateway's resident memory at that load.
scaling: 1, 2, 4 and 8 workers at a fixed step time, 16 streams each; throughput
    against linear, and the scheduler's CPU seconds per 1,000 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, update_results  # noqa: E402
from harness.stacks import PrivateStack, private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.run import Level, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402


def service(running: PrivateStack, name: str) -> psutil.Process:
    return next(psutil.Process(p.pid) for n, p in running.stack.processes if n == name)


class PeakMemory(threading.Thread):
    """The highest resident set size of a process, sampled every 0.2 s while a load runs."""

    def __init__(self, process: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.process, self.peak, self.stopped = process, 0, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            self.peak = max(self.peak, self.process.memory_info().rss)


def sim_settings(step_ms: float, slots: int) -> dict[str, str]:
    return {"ENGINE": "sim", "SIM_STEP_MS": str(step_ms), "SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": str(slots),
            "LOG_LEVEL": "WARNING"}


def load(url: str, streams: int, requests: int, new_tokens: int) -> dict:
    jobs = make_jobs(requests, Lengths("fixed", 8), Lengths("fixed", new_tokens), seed=streams)
    return asyncio.run(run_level(Target(url, "native"), jobs, Sampling(), Level(streams, None), seed=streams))


def fanout(streams: int, workers: int, step_ms: float, seconds: float) -> dict:
    """One load level: `streams` at once, each long enough to stream for about `seconds`."""
    slots, new_tokens = -(-streams // workers), round(seconds * 1000 / step_ms)
    with private_stack(workers, **sim_settings(step_ms, slots)) as running:
        gateway = service(running, "gateway")
        idle_rss = gateway.memory_info().rss
        load(running.url, 64, 64, 4)  # warm-up
        memory = PeakMemory(gateway)
        memory.start()
        cpu_before = gateway.cpu_times()
        result = load(running.url, streams, streams, new_tokens)
        cpu_after = gateway.cpu_times()
        memory.stopped.set()
        memory.join()
    itl = result["itl_s"]
    gateway_cpu = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    return {"streams": streams, "workers": workers, "step_ms": step_ms, "new_tokens": new_tokens,
            "output_tok_s": result["output_tok_s"], "failed": result["failed"], "errors": result["errors"],
            "engine_limit_tok_s": streams / (step_ms / 1000),
            "itl_p50_ms": itl["p50"] * 1000, "itl_p99_ms": itl["p99"] * 1000,
            "added_itl_p50_ms": itl["p50"] * 1000 - step_ms, "added_itl_p99_ms": itl["p99"] * 1000 - step_ms,
            "ttft_p50_ms": result["ttft_s"]["p50"] * 1000, "ttft_p99_ms": result["ttft_s"]["p99"] * 1000,
            "gateway_rss_idle_mb": idle_rss / 2**20, "gateway_rss_peak_mb": memory.peak / 2**20,
            "gateway_cpu_share": gateway_cpu / result["duration_s"]}


def scaling(worker_counts: list[int], step_ms: float, new_tokens: int, rounds: int) -> dict:
    slots, rows = 16, []
    for workers in worker_counts:
        with private_stack(workers, **sim_settings(step_ms, slots)) as running:
            scheduler = service(running, "scheduler")
            streams = slots * workers
            load(running.url, streams, streams, 4)  # warm-up
            before = scheduler.cpu_times()
            result = load(running.url, streams, rounds * streams, new_tokens)
            after = scheduler.cpu_times()
        requests = rounds * streams
        scheduler_cpu = (after.user + after.system) - (before.user + before.system)
        rows.append({"workers": workers, "streams": streams, "requests": requests,
                     "output_tok_s": result["output_tok_s"], "failed": result["failed"],
                     "engine_limit_tok_s": workers * slots / (step_ms / 1000),
                     "scheduler_cpu_s_per_1000_requests": scheduler_cpu / requests * 1000,
                     "scheduler_cpu_share": scheduler_cpu / result["duration_s"]})
        print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        row["of_linear"] = row["output_tok_s"] / (rows[0]["output_tok_s"] * row["workers"] / rows[0]["workers"])
    return {"step_ms": step_ms, "slots": slots, "new_tokens": new_tokens, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("fanout", "scaling", "both"))
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--fanout-workers", type=int, default=4)
    parser.add_argument("--fanout-step-ms", type=float, nargs="+", default=[400.0, 200.0, 133.0, 100.0],
                        help="engine step times: 1,000 streams at 400 ms offer 2,500 tok/s, at 100 ms 10,000")
    parser.add_argument("--fanout-seconds", type=float, default=20.0, help="how long each stream runs")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--scaling-step-ms", type=float, default=50.0)
    parser.add_argument("--scaling-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="requests per stream slot in the scaling runs")
    args = parser.parse_args()
    started = provenance()
    result: dict[str, object] = {}
    if args.part in ("fanout", "both"):
        result["fanout"] = []
        for step_ms in args.fanout_step_ms:
            result["fanout"].append(fanout(args.streams, args.fanout_workers, step_ms, args.fanout_seconds))
            print(json.dumps(result["fanout"][-1]), flush=True)
    if args.part in ("scaling", "both"):
        result["scaling"] = scaling(args.workers, args.scaling_step_ms, args.scaling_tokens, args.rounds)
    update_results("control_plane", started, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
