"""Issue 12, target 5a: time to first token of a shared-prefix workload with the worker's prefix cache on
and off (PREFIX_CACHE_BYTES), through the whole stack.

Every request is one shared text of about 1,000 tokens (a chat's system message; a completion's opening)
followed by a short distinct question, greedy, 16 new tokens; chat and completions, at concurrency 1 and
4. With the cache on, the first request computes the shared blocks and later ones take them from the
cache; off, every request prefills everything. The two settings take turns (a fresh stack each), and
each figure is the median over rounds. The worker's own counters give the share of prompt tokens that
came from the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stack_throughput import RESULTS  # noqa: E402
from llmserve.bench.client import Sampling, Target  # noqa: E402
from llmserve.bench.run import HEADER, Level, discover_model, format_row, run_level  # noqa: E402
from llmserve.bench.workload import Lengths, make_jobs  # noqa: E402
from llmserve.launcher import free_port, private_stack  # noqa: E402
from worker.engine import DEFAULT_PREFIX_BYTES  # noqa: E402

MODES = {"on": str(DEFAULT_PREFIX_BYTES), "off": "0"}
APIS = ("chat", "openai")


def counters(metrics_url: str) -> dict[str, float]:
    """The worker's prefix-cache counters, from its Prometheus text."""
    values = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("llmserve_worker_prefix_cache_") and not line.startswith("#"):
            values[name.removeprefix("llmserve_worker_prefix_cache_")] = float(value)
    return values


def one_round(mode: str, args: argparse.Namespace, seed: int) -> dict[str, dict]:
    port = free_port()
    settings = {"PREFIX_CACHE_BYTES": MODES[mode], "WORKER_THREADS": str(args.threads),
                "WORKER_METRICS_PORT": str(port), "LOG_LEVEL": "WARNING"}
    results = {}
    with private_stack(1, **settings) as running:
        sampling = Sampling(temperature=0.0, ignore_eos=True)
        warm = make_jobs(2, Lengths("fixed", 8), Lengths("fixed", 4), seed=99)  # no shared text: warms no cache
        asyncio.run(run_level(Target(running.url, "native"), warm, sampling, Level(2, None), show_progress=False))
        for api in APIS:
            target = Target(running.url, api)
            target = Target(running.url, api, discover_model(target))
            for concurrency in args.concurrency:
                before = counters(f"http://127.0.0.1:{port}/metrics")
                # A shared text of its own per level, so that no level finds the last one's in the cache.
                jobs = make_jobs(args.requests, Lengths("fixed", args.question_tokens), Lengths("fixed", 16),
                                 seed=seed * 100 + concurrency, shared_tokens=args.shared_tokens)
                level = asyncio.run(run_level(target, jobs, sampling, Level(concurrency, None), show_progress=False))
                after = counters(f"http://127.0.0.1:{port}/metrics")
                queried = after.get("queried_tokens_total", 0) - before.get("queried_tokens_total", 0)
                hits = after.get("hit_tokens_total", 0) - before.get("hit_tokens_total", 0)
                level["prefix_hit_share"] = hits / queried if queried else 0.0
                results[f"{api} c={concurrency}"] = level
                print(f"{mode:>4} {api:>6} c={concurrency} hit share {level['prefix_hit_share']:.2f}\n"
                      f"{HEADER}\n{format_row(level)}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=12, help="requests per level")
    parser.add_argument("--concurrency", type=lambda text: [int(c) for c in text.split(",")], default=[1, 4])
    parser.add_argument("--shared-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_number in range(args.rounds):
        for mode in MODES:
            runs[mode].append(one_round(mode, args, seed=round_number))

    def median(mode: str, case: str, metric: str, stat: str | None = None) -> float:
        return statistics.median(r[case][metric] if stat is None else r[case][metric][stat] for r in runs[mode])

    cases = list(runs["on"][0])
    summary = {case: {mode: {"ttft_p50_s": median(mode, case, "ttft_s", "p50"),
                             "ttft_p99_s": median(mode, case, "ttft_s", "p99"),
                             "e2e_p50_s": median(mode, case, "e2e_s", "p50"),
                             "output_tok_s": median(mode, case, "output_tok_s"),
                             "prefix_hit_share": median(mode, case, "prefix_hit_share")} for mode in MODES}
               for case in cases}
    for figures in summary.values():
        figures["ttft_p50_off_over_on"] = figures["off"]["ttft_p50_s"] / figures["on"]["ttft_p50_s"]
    result = {"setup": {"rounds": args.rounds, "requests": args.requests, "concurrency": args.concurrency,
                        "shared_tokens": args.shared_tokens, "question_tokens": args.question_tokens,
                        "output_tokens": 16, "threads": args.threads, "greedy": True,
                        "prefix_cache_bytes": MODES},
              "summary": summary, "runs": runs}
    (RESULTS / "prefix_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
