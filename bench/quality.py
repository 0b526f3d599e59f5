"""int8 vs fp32 on the CPU worker's model: answer agreement, batch invariance and speed, in-process.

1. Quality: 20 short chat questions, greedy, 48 new tokens, batched, through the fp32 model and the
   int8 one (`WORKER_QUANT=none` / `int8`). Per question: exact match, and token agreement = length
   of the common prefix / 48 (a row that stopped at EOS is padded with it, so equal answers score 1).
   Greedy text diverges for good at the first near-tie, so also: teacher-forced top-1 agreement, the
   share of fp32's answer tokens that int8 also ranks first when fed fp32's answer.
2. Batch invariance: each question's greedy tokens alone vs inside the batch of all the questions,
   through the worker's own continuous-batching engine, for int8 and, for reference, fp32.
3. Speed: decode ms/step (a plain loop of forwards over a KV cache; wall and CPU time) and tok/s of a static
   `model.generate` (greedy, 64 new tokens, EOS suppressed), at batch 1 and 16, median of 3 rounds;
   fp32 and int8 alternate in each round so that both see the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.own.engine import Engine  # noqa: E402
from worker.own.model import LoadedModel, load_model  # noqa: E402
from worker.own.sequences import left_padded  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "What is 12 times 7?",
    "Write a Python function that reverses a string.",
    "What is photosynthesis?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Explain what a linked list is in one sentence.",
    "What is 15 plus 27?",
    "Name three primary colors.",
    "What does HTTP stand for?",
    "Write a SQL query that counts the rows of a table named users.",
    "What is the largest planet in our solar system?",
    "Define the word 'ephemeral'.",
    "How many days are there in a leap year?",
    "What is the chemical symbol for gold?",
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "If a train travels 60 km in one hour, how far does it go in 3 hours?",
    "What is the square root of 81?",
    "Give one tip for sleeping better.",
]
ANSWER_TOKENS = 48
SPEED_TOKENS = 64


def batch_inputs(loaded: LoadedModel, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    ids, mask = left_padded(prompts, loaded.eos_token_ids[0])
    return {"input_ids": ids, "attention_mask": mask}


@torch.inference_mode()
def answers(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers of the batch, each padded with EOS to ANSWER_TOKENS."""
    inputs = batch_inputs(loaded, prompts)
    pad = loaded.eos_token_ids[0]
    out = loaded.model.generate(**inputs, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=pad)
    new = out[:, inputs["input_ids"].shape[1]:].tolist()
    return [row + [pad] * (ANSWER_TOKENS - len(row)) for row in new]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@torch.inference_mode()
def teacher_forced_top1(loaded: LoadedModel, prompt: list[int], answer: list[int]) -> list[int]:
    """The model's first choice at each position of `answer`, fed the prompt and `answer` itself."""
    logits = loaded.model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
    return logits.argmax(dim=-1).tolist()


def engine_tokens(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt through the worker's engine, all admitted at once."""
    engine = Engine(loaded, max(16, len(prompts)))
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return [tokens[str(i)] for i in range(len(prompts))]


def invariance(loaded: LoadedModel, prompts: list[list[int]]) -> int:
    together = engine_tokens(loaded, prompts)
    return sum(engine_tokens(loaded, [p])[0] == t for p, t in zip(prompts, together, strict=True))


@torch.inference_mode()
def decode_ms(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Mean ms of one decode forward of the batch (prefill excluded), with a plain KV-cache loop: wall
    time, and this process's CPU time (less sensitive to other load on a shared machine, with 1 thread)."""
    model = loaded.model
    inputs = batch_inputs(loaded, prompts)
    mask = inputs["attention_mask"]
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(**inputs, position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]
    position = positions[:, -1:]
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        mask = torch.nn.functional.pad(mask, [0, 1], value=1)
        position = position + 1
        logits = model(input_ids=logits.argmax(dim=-1, keepdim=True), attention_mask=mask, position_ids=position,
                       past_key_values=cache, use_cache=True).logits[:, -1]
    return (time.perf_counter() - start) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


@torch.inference_mode()
def generate_tok_s(loaded: LoadedModel, prompts: list[list[int]]) -> float:
    inputs = batch_inputs(loaded, prompts)
    start = time.perf_counter()
    out = loaded.model.generate(**inputs, max_new_tokens=SPEED_TOKENS, min_new_tokens=SPEED_TOKENS, do_sample=False,
                                pad_token_id=loaded.eos_token_ids[0])
    elapsed = time.perf_counter() - start
    return (out.shape[1] - inputs["input_ids"].shape[1]) * len(prompts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per ms/step measurement")
    args = parser.parse_args()
    started = provenance()
    models = {quant: load_model(Settings(worker_quant=quant, worker_threads=args.threads))
              for quant in ("none", "int8")}
    fp32, int8 = models["none"], models["int8"]
    prompts = [fp32.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]

    reference, quantised = answers(fp32, prompts), answers(int8, prompts)
    rows = []
    for question, a, b in zip(QUESTIONS, reference, quantised, strict=True):
        rows.append({"question": question, "exact": a == b, "agreement": common_prefix(a, b) / ANSWER_TOKENS,
                     "fp32": fp32.tokenizer.decode(a, skip_special_tokens=True),
                     "int8": int8.tokenizer.decode(b, skip_special_tokens=True)})
        print(f"{'=' if a == b else ' '} {rows[-1]['agreement']:5.2f}  {question}", flush=True)
    exact_share = sum(r["exact"] for r in rows) / len(rows)
    mean_agreement = statistics.mean(r["agreement"] for r in rows)
    pairs = [(teacher_forced_top1(fp32, p, a), teacher_forced_top1(int8, p, a)) for p, a in zip(prompts, reference,
                                                                                                 strict=True)]
    top1 = sum(x == y for f, q in pairs for x, y in zip(f, q, strict=True)) / sum(len(f) for f, _ in pairs)

    invariant = {name: invariance(models[quant], prompts) for name, quant in (("int8", "int8"), ("fp32", "none"))}

    speed: dict[str, dict[str, list[float]]] = {
        f"{what}_b{b}": {"fp32": [], "int8": []}
        for what in ("decode_ms_per_step", "decode_cpu_ms_per_step", "generate_tok_s") for b in (1, 16)}
    for quant in ("none", "int8"):  # warm-up
        generate_tok_s(models[quant], prompts[:2])
    for r in range(args.rounds):
        for batch in (1, 16):
            for name, quant in (("fp32", "none"), ("int8", "int8")):
                wall, cpu = decode_ms(models[quant], prompts[:batch], args.steps)
                speed[f"decode_ms_per_step_b{batch}"][name].append(wall)
                speed[f"decode_cpu_ms_per_step_b{batch}"][name].append(cpu)
                speed[f"generate_tok_s_b{batch}"][name].append(generate_tok_s(models[quant], prompts[:batch]))
        print(f"round {r + 1} (fp32 / int8): "
              + ", ".join(f"{k} {v['fp32'][-1]:.1f} / {v['int8'][-1]:.1f}" for k, v in speed.items()), flush=True)
    medians = {k: {name: statistics.median(v) for name, v in pair.items()} for k, pair in speed.items()}

    print(f"\n{'question':<70} exact  agreement")
    for r in rows:
        print(f"{r['question'][:70]:<70} {'yes' if r['exact'] else 'no':>5}  {r['agreement']:9.2f}")
    print(f"\nexact matches {exact_share:.0%} ({sum(r['exact'] for r in rows)}/{len(rows)}), "
          f"mean prefix agreement {mean_agreement:.3f}, teacher-forced top-1 agreement {top1:.3f}")
    print(f"batch invariance (engine, alone vs all {len(prompts)} together): "
          f"int8 {invariant['int8']}/{len(prompts)}, fp32 {invariant['fp32']}/{len(prompts)}")
    heading = f"median of {args.rounds}, {args.threads} threads"
    print(f"\n{heading:<32} {'fp32':>8} {'int8':>8} {'int8/fp32':>10}")
    for key, pair in medians.items():
        print(f"{key:<32} {pair['fp32']:8.1f} {pair['int8']:8.1f} {pair['int8'] / pair['fp32']:9.2f}x")

    result = {
        "answer_tokens": ANSWER_TOKENS, "questions": len(rows), "exact_match_share": exact_share,
        "mean_prefix_agreement": mean_agreement, "teacher_forced_top1_agreement": top1,
        "batch_invariant": {name: f"{n}/{len(prompts)}" for name, n in invariant.items()},
        "threads": args.threads, "rounds": args.rounds, "speed_tokens": SPEED_TOKENS,
        "speed_median": medians, "speed_rounds": speed, "answers": rows,
    }
    write_results("quality", started, result)


if __name__ == "__main__":
    main()
