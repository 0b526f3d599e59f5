"""What the compiled kernels gain the int8 decode step (worker/native.cpp): the layers with and without them,
taking turns step by step in one process over the same cache (each step's token is taken back out of the
cache, so that both see the same context). Their logits differ by float rounding, so each pair is compared by
cosine and by the chosen token. Prints the median step of each and their ratio per batch size; writes
bench/results/native.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.decode_step import parse_and_load, prefilled  # noqa: E402
from bench.stack_throughput import RESULTS  # noqa: E402
from worker.forward import Part, forward_parts  # noqa: E402
from worker.quant import Int8Linear, Int8LlamaLayer  # noqa: E402


def use(model: torch.nn.Module, compiled: bool) -> None:
    for module in model.modules():
        if isinstance(module, Int8Linear | Int8LlamaLayer):
            module.native = compiled


@torch.inference_mode()
def measure(model: torch.nn.Module, rows: int, context: int, steps: int) -> dict:
    cache = prefilled(model, rows, context)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    cosines, same_tokens = [], 0
    for step in range(steps + 2):  # the first two warm up
        tokens = torch.randint(100, 1000, (rows, 1))
        logits = {}
        for compiled in (step % 2 == 0, step % 2 == 1):  # who goes first alternates
            use(model, compiled)
            start = time.perf_counter()
            logits[compiled] = forward_parts(model, [Part(tokens, torch.full((rows, 1), context), cache)])[0]
            if step >= 2:
                seconds[compiled].append(time.perf_counter() - start)
            rows_of = cache.layers[0].rows
            rows_of.lengths = [n - 1 for n in rows_of.lengths]  # the token out again
        cosines.append(torch.nn.functional.cosine_similarity(logits[True], logits[False], dim=-1).min().item())
        same_tokens += int((logits[True].argmax(-1) == logits[False].argmax(-1)).sum())
    use(model, compiled=True)
    scripted_ms, native_ms = (statistics.median(seconds[kind]) * 1e3 for kind in (False, True))
    return {"rows": rows, "scripted_ms": scripted_ms, "native_ms": native_ms, "speedup": scripted_ms / native_ms,
            "min_cosine": min(cosines), "same_token_share": same_tokens / (rows * (steps + 2))}


def main() -> None:
    args, model = parse_and_load(__doc__.splitlines()[0], 40, RESULTS / "native.json")
    if not model.model.layers[0].native:
        sys.exit("worker/native.cpp did not build here (see the worker's warning); nothing to compare")
    print(f"{'rows':>5} {'scripted ms':>12} {'native ms':>10} {'speedup':>8} {'min cosine':>11} {'same token':>11}")
    levels = []
    for rows in args.rows:
        levels.append(measure(model, rows, args.context, args.steps))
        level = levels[-1]
        print(f"{rows:>5} {level['scripted_ms']:>12.1f} {level['native_ms']:>10.1f} {level['speedup']:>7.2f}x "
              f"{level['min_cosine']:>11.5f} {level['same_token_share']:>10.0%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": {"context": args.context, "steps": args.steps, "threads": args.threads,
                                              "cpu_capability": torch.backends.cpu.get_cpu_capability()},
                                    "levels": levels}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
