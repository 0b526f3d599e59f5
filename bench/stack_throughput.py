"""Issue 2's figures, side by side in one run on one machine:

1. the full stack (redis-server, gateway, scheduler, one worker as processes),
   16 concurrent greedy streams of 64 new tokens, and concurrency 1;
2. the limit: plain in-process `model.generate` on the same 16 prompts as one
   static batch, same model and threads;
3. the seed's design re-created: no KV cache, the whole sequence re-run for every
   token, 4 slots.

Stack and `generate` rounds alternate so that both see the same machine; the
seed's design is slow and runs once. Prints medians and ratios, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import RESULTS, provenance, write_results  # noqa: E402,F401 (RESULTS: other benches' import)
from common.settings import Settings  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.run import Level, run_level  # noqa: E402
from llmserve.loadgen.workload import Job  # noqa: E402
from worker.own.model import LoadedModel, load_model  # noqa: E402
from worker.weights.quant import Int8Linear  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who",
    "Explain why the sky is blue in simple words:",
    "The history of the printing press begins",
    "List three ideas for a rainy Sunday afternoon:",
    "def quicksort(items):",
    "The best way to learn a new language is",
    "Once upon a time, a robot named Pip",
    "Describe the taste of a fresh strawberry.",
    "In the year 2150, cities will",
    "A recipe for pancakes starts with",
    "The three laws of thermodynamics are",
    "My favourite mountain hike goes through",
    "Summarise the plot of Hamlet:",
    "Dear diary, today I finally",
    "The stock market fell sharply because",
    "How do bees make honey? They",
]


def stack_round(url: str, prompts: list[str], new_tokens: int, concurrency: int) -> dict[str, object]:
    """The prompts through the stack's native API, `concurrency` at a time, timed by `llmserve bench`'s client."""
    jobs = [Job(prompt, new_tokens) for prompt in prompts]
    return asyncio.run(run_level(Target(url, "native"), jobs, Sampling(temperature=0.0, ignore_eos=True),
                                 Level(concurrency, None), show_progress=False))


def generate_round(loaded: LoadedModel, prompts: list[str], new_tokens: int) -> float:
    tokenizer = loaded.tokenizer
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=loaded.eos_token_ids[0])
    elapsed = time.perf_counter() - start
    return (out.shape[1] - inputs["input_ids"].shape[1]) * len(prompts) / elapsed


def seed_design_round(loaded: LoadedModel, prompts: list[str], new_tokens: int, slots: int = 4) -> float:
    """The seed's loop: 4 slots, every step re-runs the whole padded sequence with no cache."""
    tokenizer = loaded.tokenizer
    tokenizer.padding_side = "left"
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), slots):
            texts = list(prompts[i:i + slots])
            for _ in range(new_tokens):
                # The seed re-tokenises the grown text and re-runs all of it every token.
                inputs = tokenizer(texts, return_tensors="pt", padding=True)
                logits = loaded.model(**inputs, use_cache=False).logits[:, -1]
                logits[:, loaded.eos_token_ids] = float("-inf")
                for row, token in enumerate(logits.argmax(-1).tolist()):
                    texts[row] += tokenizer.decode([token])
                produced += len(texts)
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--skip-seed", action="store_true")
    parser.add_argument("--out", help="default: bench/results/stack_throughput-<host kind>.json")
    args = parser.parse_args()
    started = provenance()

    torch.set_num_threads(args.threads)
    loaded = load_model(Settings(worker_threads=args.threads))
    with private_stack(1, WORKER_THREADS=str(args.threads), LOG_LEVEL="WARNING") as running:
        url = running.url
        stack_round(url, PROMPTS[:2], 8, 2)  # warm-up
        generate_round(loaded, PROMPTS[:2], 8)
        stack16, generate16 = [], []
        for r in range(args.rounds):
            stack16.append(stack_round(url, PROMPTS, args.new_tokens, 16))
            generate16.append(generate_round(loaded, PROMPTS, args.new_tokens))
            print(f"round {r + 1}: stack {stack16[-1]['output_tok_s']:.1f} tok/s, generate {generate16[-1]:.1f} tok/s",
                  flush=True)
        stack1 = stack_round(url, PROMPTS[:4], args.new_tokens, 1)
    seed = None if args.skip_seed else seed_design_round(loaded, PROMPTS, args.new_tokens)

    stack_tok_s = statistics.median(r["output_tok_s"] for r in stack16)
    generate_tok_s = statistics.median(generate16)

    def c16(metric: str, stat: str) -> float:
        return statistics.median(r[metric][stat] for r in stack16)

    result = {
        "setup": {"prompts": len(PROMPTS), "new_tokens": args.new_tokens, "threads": args.threads,
                  "rounds": args.rounds, "model": Settings().model, "greedy": True,
                  "int8": any(isinstance(m, Int8Linear) for m in loaded.model.modules())},
        "stack_c16_tok_s_median": stack_tok_s,
        "generate_static_b16_tok_s_median": generate_tok_s,
        "stack_over_generate": stack_tok_s / generate_tok_s,
        "seed_design_tok_s": seed,
        "stack_over_seed": stack_tok_s / seed if seed else None,
        "c16_ttft_p50_s": c16("ttft_s", "p50"), "c16_ttft_p99_s": c16("ttft_s", "p99"),
        "c16_itl_p50_s": c16("itl_s", "p50"), "c16_itl_p99_s": c16("itl_s", "p99"),
        "c1_tok_s": stack1["output_tok_s"],
        "c1_ttft_p50_s": stack1["ttft_s"]["p50"], "c1_ttft_p99_s": stack1["ttft_s"]["p99"],
        "c1_itl_p50_s": stack1["itl_s"]["p50"], "c1_itl_p99_s": stack1["itl_s"]["p99"],
        "stack_rounds_tok_s": [r["output_tok_s"] for r in stack16], "generate_rounds_tok_s": generate16,
    }
    write_results("stack_throughput", started, result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
