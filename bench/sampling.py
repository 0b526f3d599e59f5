"""Sampled requests against greedy ones on the stack: what top-k, top-p and temperature cost a decode step.

Most clients sample: the OpenAI API's default temperature is 1. Three workloads take turns on one stack
(one worker), each at every concurrency: greedy (temperature 0), the OpenAI API's defaults (temperature 1,
top_p 1: the whole vocabulary), those of llmserve's own /generate (temperature 0.7, top_p 0.95, top_k 50)
and a nucleus over the whole vocabulary (top_p 0.9). Reported: output tok/s per workload and its ratio to
greedy's, medians over rounds. 32-token prompts, 64 forced new tokens, twice as many requests as in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.run import HEADER, Level, discover_model, format_row, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402

# name -> (API, sampling); the seed makes every round draw the same tokens
WORKLOADS = {
    "greedy": ("openai", Sampling(temperature=0.0)),
    "OpenAI defaults": ("chat", Sampling(temperature=1.0, top_p=1.0, seed=1)),
    "/generate defaults": ("native", Sampling(temperature=0.7, top_p=0.95, seed=1)),
    "top_p 0.9": ("chat", Sampling(temperature=1.0, top_p=0.9, seed=1)),
}


async def one_round(url: str, concurrencies: list[int], new_tokens: int, seed: int) -> dict[str, list[dict]]:
    model = discover_model(Target(url, "openai"))  # the native API ignores it
    results: dict[str, list[dict]] = {}
    for name, (api, sampling) in WORKLOADS.items():
        target = Target(url, api, model)
        print(f"\n{name}\n{HEADER}", flush=True)
        for concurrency in concurrencies:
            jobs = make_jobs(max(8, 2 * concurrency), Lengths("fixed", 32), Lengths("fixed", new_tokens),
                             seed=seed + concurrency)
            level = await run_level(target, jobs, sampling, Level(concurrency, None), show_progress=False)
            print(format_row(level), flush=True)
            results.setdefault(name, []).append(level)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="default: bench/results/sampling-<host kind>.json")
    args = parser.parse_args()
    started = provenance()
    settings = {"WORKER_THREADS": str(args.threads), "LOG_LEVEL": "WARNING"}
    rounds = []
    with private_stack(1, **settings) as running:
        warm = make_jobs(4, Lengths("fixed", 32), Lengths("fixed", 8), seed=99)
        asyncio.run(run_level(Target(running.url, "native"), warm, Sampling(), Level(4, None), show_progress=False))
        for round_number in range(args.rounds):
            rounds.append(asyncio.run(one_round(running.url, args.concurrency, args.new_tokens, 100 * round_number)))

    def median_tok_s(name: str, index: int) -> float:
        return statistics.median(r[name][index]["output_tok_s"] for r in rounds)

    summary = {}
    for index, concurrency in enumerate(args.concurrency):
        greedy = median_tok_s("greedy", index)
        summary[str(concurrency)] = {name: {"output_tok_s": median_tok_s(name, index),
                                            "over_greedy": median_tok_s(name, index) / greedy}
                                     for name in WORKLOADS}
    result = {"setup": {"concurrency": args.concurrency, "new_tokens": args.new_tokens, "prompt_tokens": 32,
                        "rounds": args.rounds, "threads": args.threads,
                        "workloads": {name: {"api": api, **vars(s)} for name, (api, s) in WORKLOADS.items()}},
              "summary": summary, "rounds": rounds}
    write_results("sampling", started, result, args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
