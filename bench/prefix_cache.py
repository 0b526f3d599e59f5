"""Issue 12, target 5a: time to first token of a shared-prefix workload with the worker's prefix cache on
and off (PREFIX_CACHE_BYTES), through the whole stack.

Every request is one shared text of about 1,000 tokens (a chat's system message; a completion's opening)
followed by a short distinct question, greedy, 16 new tokens; chat and completions, at concurrency 1 and
4. With the cache on, the first request computes the shared blocks and later ones take them from the
cache; off, every request prefills everything. The two settings take turns (a fresh stack each), and
each figure is the median over rounds. The worker's own counters give the share of prompt tokens that
came from the cache. With --llama-server PATH, llama.cpp's server on the same GGUF takes its turn too, with
its own prompt cache (a slot keeps its last prompt's keys and values, and a request goes to the slot whose
prompt it shares most with).
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

from bench.peers import LLAMA_SERVER, peer_server  # noqa: E402
from bench.provenance import provenance, write_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.run import HEADER, Level, discover_model, format_row, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402
from llmserve.processes import free_port  # noqa: E402
from worker.own.engine import DEFAULT_PREFIX_BYTES  # noqa: E402
from worker.prompts import bundled_gguf  # noqa: E402

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


def run_cases(name: str, url: str, args: argparse.Namespace, seed: int, metrics_url: str | None) -> dict[str, dict]:
    """Every (api, concurrency) case against the server at `url`; with `metrics_url`, a worker's cache counters."""
    results = {}
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    for api in APIS:
        target = Target(url, api)
        target = Target(url, api, discover_model(target))
        for concurrency in args.concurrency:
            before = counters(metrics_url) if metrics_url else {}
            # A shared text of its own per level, so that no level finds the last one's in the cache.
            jobs = make_jobs(args.requests, Lengths("fixed", args.question_tokens), Lengths("fixed", 16),
                             seed=seed * 100 + concurrency, shared_tokens=args.shared_tokens)
            level = asyncio.run(run_level(target, jobs, sampling, Level(concurrency, None), show_progress=False))
            if metrics_url:
                after = counters(metrics_url)
                queried = after.get("queried_tokens_total", 0) - before.get("queried_tokens_total", 0)
                hits = after.get("hit_tokens_total", 0) - before.get("hit_tokens_total", 0)
                level["prefix_hit_share"] = hits / queried if queried else 0.0
            results[f"{api} c={concurrency}"] = level
            share = f" hit share {level['prefix_hit_share']:.2f}" if metrics_url else ""
            print(f"{name:>12} {api:>6} c={concurrency}{share}\n{HEADER}\n{format_row(level)}", flush=True)
    return results


def one_round(mode: str, args: argparse.Namespace, seed: int) -> dict[str, dict]:
    if mode == "llama-server":
        port = free_port()
        argv = [args.llama_server, "-m", bundled_gguf(), "-t", str(args.threads), "-c", "8192", "--parallel",
                str(max(args.concurrency)), "-cb", "--host", "127.0.0.1", "--port", str(port)]
        with peer_server(argv, {}, port, Path("/tmp/prefix_cache_llama_server.log")) as url:
            return run_cases(mode, url, args, seed, None)
    port = free_port()
    settings = {"PREFIX_CACHE_BYTES": MODES[mode], "WORKER_THREADS": str(args.threads),
                "WORKER_METRICS_PORT": str(port), "LOG_LEVEL": "WARNING"}
    with private_stack(1, **settings) as running:
        warm = make_jobs(2, Lengths("fixed", 8), Lengths("fixed", 4), seed=99)  # no shared text: warms no cache
        asyncio.run(run_level(Target(running.url, "native"), warm, Sampling(temperature=0.0, ignore_eos=True),
                              Level(2, None), show_progress=False))
        return run_cases(f"llmserve {mode}", running.url, args, seed, f"http://127.0.0.1:{port}/metrics")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=12, help="requests per level")
    parser.add_argument("--concurrency", type=lambda text: [int(c) for c in text.split(",")], default=[1, 4])
    parser.add_argument("--shared-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default: bench/results/prefix_cache-<host kind>.json")
    parser.add_argument("--llama-server", help=f"llama.cpp's server binary, a third series (e.g. {LLAMA_SERVER})")
    args = parser.parse_args()
    started = provenance()

    modes = [*MODES, "llama-server"] if args.llama_server else list(MODES)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_number in range(args.rounds):
        for mode in modes:
            runs[mode].append(one_round(mode, args, seed=round_number))

    def median(mode: str, case: str, metric: str, stat: str | None = None) -> float:
        return statistics.median(r[case][metric] if stat is None else r[case][metric][stat] for r in runs[mode])

    cases = list(runs["on"][0])
    summary = {case: {mode: {"ttft_p50_s": median(mode, case, "ttft_s", "p50"),
                             "ttft_p99_s": median(mode, case, "ttft_s", "p99"),
                             "e2e_p50_s": median(mode, case, "e2e_s", "p50"),
                             "output_tok_s": median(mode, case, "output_tok_s"),
                             **({"prefix_hit_share": median(mode, case, "prefix_hit_share")} if mode in MODES else {})}
                      for mode in modes}
               for case in cases}
    for figures in summary.values():
        figures["ttft_p50_off_over_on"] = figures["off"]["ttft_p50_s"] / figures["on"]["ttft_p50_s"]
        if "llama-server" in figures:
            peer = figures["llama-server"]["ttft_p50_s"]
            figures["ttft_p50_llama_server_over_on"] = peer / figures["on"]["ttft_p50_s"]
    result = {"setup": {"rounds": args.rounds, "requests": args.requests, "concurrency": args.concurrency,
                        "shared_tokens": args.shared_tokens, "question_tokens": args.question_tokens,
                        "output_tokens": 16, "threads": args.threads, "greedy": True,
                        "prefix_cache_bytes": MODES},
              "summary": summary, "runs": runs}
    write_results("prefix_cache", started, result, args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
