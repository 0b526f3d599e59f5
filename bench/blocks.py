"""The decode step on the GGUF file's own blocks (worker/weights/blocks.py, the default) against the int8 layers
(worker/weights/quant.py, WORKER_QUANT=int8), taking turns step by step in one process: each model over its own cache
of the same random prompts, each step's token taken back out so that every step sees the same context. Prints
the median step of each, their ratio and the weight bytes one step reads, per batch size; writes
bench/results/blocks-<host kind>.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.decode_step import parse_and_load, write_levels  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.own.cache import new_cache  # noqa: E402
from worker.own.forward import Part, forward_parts  # noqa: E402
from worker.own.model import load_model  # noqa: E402
from worker.weights.blocks import BlockLinear  # noqa: E402
from worker.weights.quant import Int8Linear  # noqa: E402


def weight_bytes(model: torch.nn.Module) -> int:
    """What one decode step reads of the linear layers' weights: int8's packed bytes (one a weight), or the
    packed blocks (codes and float16 scales)."""
    total = 0
    for module in model.modules():
        if isinstance(module, BlockLinear):
            total += module.packed.numel()
        elif isinstance(module, Int8Linear):
            total += module.in_features * module.out_features
    return total


@torch.inference_mode()
def measure(models: dict[str, torch.nn.Module], rows: int, context: int, steps: int) -> dict:
    prompt = torch.randint(100, 1000, (rows, context))
    caches = {}
    for name, model in models.items():
        caches[name] = new_cache(model.config, ragged=True)
        forward_parts(model, [Part(prompt, torch.arange(context).expand(rows, context), caches[name])])
    seconds: dict[str, list[float]] = {name: [] for name in models}
    same = 0
    names = list(models)
    for step in range(steps + 2):
        tokens = torch.randint(100, 1000, (rows, 1))
        logits = {}
        for name in names if step % 2 == 0 else names[::-1]:  # who goes first alternates
            cache = caches[name]
            start = time.perf_counter()
            logits[name] = forward_parts(models[name], [Part(tokens, torch.full((rows, 1), context), cache)])[0]
            if step >= 2:
                seconds[name].append(time.perf_counter() - start)
            held = cache.layers[0].rows
            held.lengths = [n - 1 for n in held.lengths]
        same += int((logits[names[0]].argmax(-1) == logits[names[1]].argmax(-1)).sum()) if step >= 2 else 0
    ms = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
    return {"rows": rows, **{f"{name}_ms": value for name, value in ms.items()},
            "speedup": ms[names[1]] / ms[names[0]], "same_token_share": same / (rows * steps)}


def main() -> None:
    args, blocks = parse_and_load(__doc__.splitlines()[0], 40, "blocks")
    models = {"gguf": blocks, "int8": load_model(Settings(worker_threads=args.threads, worker_quant="int8")).model}
    sizes = {name: weight_bytes(model) for name, model in models.items()}
    print(f"weights read per step: gguf blocks {sizes['gguf'] / 1e6:.1f} MB, int8 {sizes['int8'] / 1e6:.1f} MB")
    print(f"{'rows':>5} {'gguf ms':>8} {'int8 ms':>8} {'speedup':>8} {'same token':>11}")
    levels = []
    for rows in args.rows:
        level = measure(models, rows, args.context, args.steps)
        levels.append(level)
        print(f"{rows:>5} {level['gguf_ms']:>8.1f} {level['int8_ms']:>8.1f} {level['speedup']:>7.2f}x "
              f"{level['same_token_share']:>10.0%}", flush=True)
    write_levels(args, levels, weight_bytes=sizes)


if __name__ == "__main__":
    main()
