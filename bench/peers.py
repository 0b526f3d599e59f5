"""Issue 6, target 3: llmserve against llama.cpp on the very same GGUF file, measured
by one harness (the sweep of `llmserve bench`) in one run. The servers take turns on
the machine, each alone, for several rounds, and get the same greedy workload at each
concurrency; each level reports its median round.

The peers are built outside this repository (docs/benchmarks.md says how):
`--llama-server` is llama.cpp's native server binary, `--llama-cpp-python` the Python
of a venv with `llama-cpp-python[server]`. A peer whose path is missing is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.plot import plot_sweeps  # noqa: E402
from llmserve.loadgen.run import HEADER, Level, discover_model, format_row, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402
from llmserve.processes import free_port, wait_until  # noqa: E402
from worker.prompts import bundled_gguf  # noqa: E402

LLAMA_SERVER = "/tmp/peer/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
LLAMA_CPP_PYTHON = "/tmp/peer/venv/bin/python"


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def peer_server(argv: list[str], env: dict[str, str], port: int, log: Path) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until(lambda: answers(url) or process.poll() is not None, 180, argv[0])
            if process.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited; see {log}")
            yield url
        finally:
            process.terminate()
            process.wait(30)


async def measure(url: str, args: argparse.Namespace, name: str) -> list[dict]:
    """Per level of args.concurrency, twice as many requests as are in flight (at least 8), so every level runs
    full."""
    target = Target(url, "openai")
    target = Target(url, "openai", discover_model(target))
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    prompt = Lengths("fixed", args.prompt_tokens)
    await run_level(target, make_jobs(4, prompt, Lengths("fixed", 8), 99), sampling, Level(4, None),
                    show_progress=False)
    print(f"\n{name} at {url}\n{HEADER}", flush=True)
    levels = []
    for concurrency in args.concurrency:
        jobs = make_jobs(max(8, 2 * concurrency), prompt, Lengths("fixed", args.new_tokens), seed=concurrency)
        levels.append(await run_level(target, jobs, sampling, Level(concurrency, None), seed=concurrency))
        print(format_row(levels[-1]), flush=True)
        for error in levels[-1]["errors"]:
            print(f"  failed: {error}", flush=True)
    return levels


def median_levels(runs: list[list[dict]]) -> list[dict]:
    """Per load level, the figures of the round with the median output tokens/s (the lower one of an even
    count), so that one level's figures all come from one run."""
    return [sorted(levels, key=lambda level: level["output_tok_s"])[(len(levels) - 1) // 2]
            for levels in zip(*runs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", default=LLAMA_SERVER)
    parser.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns of every server; each level reports its median round by output tok/s")
    parser.add_argument("--benchmark", default="peers",
                        help="the results' name, for a variant run (bench/results/<name>-<host kind>.json)")
    parser.add_argument("--out", help="default: bench/results/<benchmark>-<host kind>.json (and its plot beside it)")
    parser.add_argument("--scripted-too", action="store_true",
                        help="a second llmserve series with WORKER_NATIVE=off (the compiled kernels off)")
    parser.add_argument("--int8-too", action="store_true",
                        help="a llmserve series with WORKER_QUANT=int8 (instead of the GGUF blocks)")
    args = parser.parse_args()
    started = provenance()
    gguf, threads, logs = bundled_gguf(), str(args.threads), Path("/tmp")
    # A slot for every stream of the highest level, 512 tokens of context each (what a user sizing llama-server
    # for this load would give it), so that no level queues behind its slots.
    slots = max(args.concurrency)
    context = 512 * slots

    peers = {
        "llama-server": (args.llama_server, {}, [args.llama_server, "-m", gguf, "-t", threads, "-c", str(context),
                                                 "--parallel", str(slots), "-cb", "--host", "127.0.0.1", "--port"]),
        # Built against llama-server's shared libraries (no second compile), which it finds through this variable.
        "llama-cpp-python": (args.llama_cpp_python, {"LLAMA_CPP_LIB_PATH": str(Path(args.llama_server).parent)},
                             # By default a new request interrupts the one streaming; queue them instead.
                             [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", gguf, "--n_threads",
                              threads, "--n_ctx", "8192", "--interrupt_requests", "False",
                              "--host", "127.0.0.1", "--port"]),
    }
    missing = [name for name, (path, _, _) in peers.items() if not os.path.exists(path)]
    for name in missing:
        print(f"\n{name}: {peers.pop(name)[0]} not found, skipped")
    ours = {"llmserve": {}, **({"llmserve-int8": {"WORKER_QUANT": "int8"}} if args.int8_too else {}),
            **({"llmserve-scripted": {"WORKER_NATIVE": "off"}} if args.scripted_too else {})}
    rounds: dict[str, list[list[dict]]] = {name: [] for name in [*ours, *peers]}
    for _ in range(args.rounds):  # the servers take turns, so that each round sees one state of the machine
        for name, env in ours.items():
            with private_stack(1, WORKER_THREADS=threads, WORKER_SLOTS=str(max(args.concurrency)),
                               LOG_LEVEL="WARNING", **env) as stack:
                rounds[name].append(asyncio.run(measure(stack.url, args, name)))
        for name, (_, env, argv) in peers.items():
            port = free_port()
            with peer_server([*argv, str(port)], {**os.environ, **env}, port, logs / f"bench-{name}.log") as url:
                rounds[name].append(asyncio.run(measure(url, args, name)))
    series = {name: median_levels(runs) for name, runs in rounds.items()}

    ratios = {}
    if "llama-server" in series:
        for ours, peer in zip(series["llmserve"], series["llama-server"], strict=True):
            ratios[str(ours["concurrency"])] = {
                "tok_s_ratio": ours["output_tok_s"] / peer["output_tok_s"],
                "ttft_p50_s": {"llmserve": ours["ttft_s"]["p50"], "llama-server": peer["ttft_s"]["p50"]}}
    result = {"setup": {"gguf": gguf, "threads": args.threads, "new_tokens": args.new_tokens,
                        "prompt_tokens": args.prompt_tokens, "greedy": True, "concurrency": args.concurrency,
                        "rounds": args.rounds, "llama_server_slots": slots, "llama_server_context": context},
              "series": series, "llmserve_over_llama_server": ratios,
              "rounds_output_tok_s": {name: [[level["output_tok_s"] for level in run] for run in runs]
                                      for name, runs in rounds.items()}}
    out = write_results(args.benchmark, started, result, args.out)
    plot_sweeps(series, out.with_suffix(".png"), title=f"{args.new_tokens} new tokens, greedy, same GGUF")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
