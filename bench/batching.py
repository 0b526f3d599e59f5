"""Issue 6, target 4: continuous against static batching of the same engine, under
Poisson arrivals with mixed output lengths (the load continuous batching exists for).

Static batching (WORKER_BATCHING=static) admits a batch only when the previous one
has wholly finished, so a short request waits for the longest of its batch and
arrivals wait for the whole batch. Same stack, same model, same workload; the modes
alternate when there is more than one round.
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
from llmserve.loadgen.run import HEADER, Level, format_row, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402

MODES = ("continuous", "static")


def one_round(mode: str, rate: float, requests: int, outputs: Lengths, threads: int, engine: str) -> dict:
    with private_stack(1, WORKER_BATCHING=mode, WORKER_THREADS=str(threads), ENGINE=engine,
                       LOG_LEVEL="WARNING") as running:
        target = Target(running.url, "native")
        sampling = Sampling(temperature=0.0, ignore_eos=True)
        warm = make_jobs(4, Lengths("fixed", 32), Lengths("fixed", 8), seed=99)
        asyncio.run(run_level(target, warm, sampling, Level(4, None), show_progress=False))
        jobs = make_jobs(requests, Lengths("fixed", 32), outputs, seed=1)
        return asyncio.run(run_level(target, jobs, sampling, Level(None, rate), seed=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=Lengths.parse, default=Lengths("uniform", 16, 256))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", choices=("hf", "sim"), default="hf",
                        help="sim: the same comparison on ENGINE=sim workers (fixed step times, no model)")
    args = parser.parse_args()
    started = provenance()

    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(one_round(mode, args.rate, args.requests, args.output_tokens, args.threads,
                                             args.engine))
            print(f"{mode}\n{HEADER}\n{format_row(runs[mode][-1])}", flush=True)

    def median(mode: str, metric: str, stat: str | None = None) -> float:
        return statistics.median(r[metric] if stat is None else r[metric][stat] for r in runs[mode])

    summary = {mode: {"output_tok_s": median(mode, "output_tok_s"), "e2e_p50_s": median(mode, "e2e_s", "p50"),
                      "e2e_p99_s": median(mode, "e2e_s", "p99"), "ttft_p50_s": median(mode, "ttft_s", "p50"),
                      "ttft_p99_s": median(mode, "ttft_s", "p99")} for mode in MODES}
    cont, static = summary["continuous"], summary["static"]
    result = {"setup": {"rate": args.rate, "requests": args.requests, "output_tokens": str(args.output_tokens),
                        "prompt_tokens": 32, "rounds": args.rounds, "engine": args.engine, "threads": args.threads,
                        "greedy": True},
              "summary": summary,
              "continuous_over_static_tok_s": cont["output_tok_s"] / static["output_tok_s"],
              "static_over_continuous_e2e_p99": static["e2e_p99_s"] / cont["e2e_p99_s"],
              "runs": runs}
    write_results(f"batching_{args.engine}", started, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
