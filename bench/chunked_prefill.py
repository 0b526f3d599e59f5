"""Issue 12, target 5b: inter-token latency of running streams while long prompts arrive, with chunked
prefill (PREFILL_CHUNK, the default) and without (PREFILL_CHUNK=0: each prompt prefilled whole in one step).

16 greedy streams (32-token prompts, 256 new tokens) run on one worker; once they all stream, prompts of
about 2,000 tokens arrive (distinct, so no prefix cache helps; 4 new tokens each), one every few seconds.
Reported: the streams' inter-token latency (every gap between two tokens of a stream, all 16 streams)
p50 / p99 / max, against the same streams with no arrivals; and the long prompts' time to first token, the
price chunking pays. `--blocks 8,32` adds chunked runs with other PREFILL_BLOCK sizes (one block per step).
The settings take turns (a fresh stack each); figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Outcome, Sampling, Target, stream  # noqa: E402
from llmserve.loadgen.run import Level, run_level  # noqa: E402
from llmserve.loadgen.stats import describe  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402
from worker.own.planner import DEFAULT_CHUNK  # noqa: E402

STREAMS = 16
# mode -> (PREFILL_BLOCK, PREFILL_CHUNK); "0" block: the worker's default
MODES = {"chunked": ("0", str(DEFAULT_CHUNK)), "unchunked": ("0", "0")}


async def streams_with_arrivals(target: Target, args: argparse.Namespace, arrivals: int,
                                seed: int) -> tuple[list[Outcome], list[Outcome]]:
    """The running streams, and the long prompts sent meanwhile (the first once every stream has a token)."""
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    jobs = make_jobs(STREAMS, Lengths("fixed", 32), Lengths("fixed", args.stream_tokens), seed=seed)
    long_jobs = make_jobs(arrivals, Lengths("fixed", args.long_tokens), Lengths("fixed", 4), seed=seed + 50)
    running = [asyncio.create_task(stream(target, job, sampling)) for job in jobs]
    await asyncio.sleep(args.lead)
    arriving = []
    for job in long_jobs:
        arriving.append(asyncio.create_task(stream(target, job, sampling)))
        await asyncio.sleep(args.gap)
    return list(await asyncio.gather(*running)), list(await asyncio.gather(*arriving))


def gaps(outcomes: list[Outcome]) -> list[float]:
    return [b - a for o in outcomes if o.ok for a, b in itertools.pairwise(o.token_times)]


def one_round(mode: str, args: argparse.Namespace, seed: int, baseline: bool) -> dict[str, dict]:
    block, chunk = args.modes[mode]
    settings = {"PREFILL_BLOCK": block, "PREFILL_CHUNK": chunk, "WORKER_THREADS": str(args.threads),
                "WORKER_SLOTS": "24", "LOG_LEVEL": "WARNING"}
    results = {}
    with private_stack(1, **settings) as running:
        target = Target(running.url, "native")
        warm = make_jobs(4, Lengths("fixed", 32), Lengths("fixed", 4), seed=99)
        asyncio.run(run_level(target, warm, Sampling(temperature=0.0), Level(4, None), show_progress=False))
        cases = {"no arrivals": 0, mode: args.arrivals} if baseline else {mode: args.arrivals}
        for case, arrivals in cases.items():
            streams, long_prompts = asyncio.run(streams_with_arrivals(target, args, arrivals, seed))
            failed = sum(not o.ok for o in [*streams, *long_prompts])
            itl = describe(gaps(streams))
            itl["max"] = max(gaps(streams))
            ttft = describe([o.token_times[0] - o.sent for o in long_prompts if o.ok])
            results[case] = {"itl_s": itl, "long_ttft_s": ttft, "failed": failed}
            print(f"{case:>12}: ITL p50 {itl['p50'] * 1000:.0f} ms, p99 {itl['p99'] * 1000:.0f} ms, "
                  f"max {itl['max'] * 1000:.0f} ms; long prompts' TTFT p50 "
                  f"{(ttft['p50'] or 0) * 1000:.0f} ms; failed {failed}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arrivals", type=int, default=3, help="long prompts per run")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--lead", type=float, default=2.0, help="seconds before the first long prompt")
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", default="", help="more chunked runs: PREFILL_BLOCK sizes, a comma list")
    parser.add_argument("--out", type=Path, help="default: bench/results/chunked_prefill-<host kind>.json")
    args = parser.parse_args()
    started = provenance()
    args.modes = dict(MODES)
    for size in filter(None, args.blocks.split(",")):
        args.modes[f"block {size}"] = (size, size)

    runs: list[dict[str, dict]] = []
    for round_number in range(args.rounds):
        merged: dict[str, dict] = {}
        for mode in args.modes:
            merged |= one_round(mode, args, seed=round_number, baseline=mode == "chunked")
        runs.append(merged)

    def median(case: str, metric: str, stat: str) -> float:
        return statistics.median(r[case][metric][stat] for r in runs)

    summary = {case: {"itl_p50_s": median(case, "itl_s", "p50"), "itl_p99_s": median(case, "itl_s", "p99"),
                      "itl_max_s": median(case, "itl_s", "max")} for case in runs[0]}
    for case in args.modes:
        summary[case]["long_ttft_p50_s"] = median(case, "long_ttft_s", "p50")
        summary[case]["itl_p99_over_no_arrivals"] = summary[case]["itl_p99_s"] / summary["no arrivals"]["itl_p99_s"]
    result = {"setup": {"rounds": args.rounds, "streams": STREAMS, "stream_tokens": args.stream_tokens,
                        "arrivals": args.arrivals, "long_tokens": args.long_tokens, "lead_s": args.lead,
                        "gap_s": args.gap, "threads": args.threads, "prefill_block_and_chunk": args.modes,
                        "greedy": True},
              "summary": summary, "runs": runs}
    write_results("chunked_prefill", started, result, args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
