"""What TorchScript gains the int8 decode step (worker/scripted.py): the same functions run eagerly, by Python,
and scripted, taking turns step by step in one process over the same cache (each step's token is taken back
out of the cache, so that both see the same context), with the logits of each pair compared bit for bit.
Prints the median step of each and their ratio per batch size; writes bench/results/scripted.json.
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
from worker import scripted  # noqa: E402
from worker.forward import Part, forward_parts  # noqa: E402

COMPILED = {name: getattr(scripted, name) for name in scripted.PLAIN}


def use(eager: bool) -> None:
    """Point the module's names (which quant.py, cache.py and the plain functions themselves call) at one kind."""
    for name, function in (scripted.PLAIN if eager else COMPILED).items():
        setattr(scripted, name, function)


@torch.inference_mode()
def measure(model: torch.nn.Module, rows: int, context: int, steps: int) -> dict:
    cache = prefilled(model, rows, context)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    identical = True
    for step in range(steps + 2):  # the first two warm up
        tokens = torch.randint(100, 1000, (rows, 1))
        logits = {}
        for eager in (step % 2 == 0, step % 2 == 1):  # who goes first alternates
            use(eager)
            start = time.perf_counter()
            logits[eager] = forward_parts(model, [Part(tokens, torch.full((rows, 1), context), cache)])[0]
            if step >= 2:
                seconds[eager].append(time.perf_counter() - start)
            rows_of = cache.layers[0].rows
            rows_of.lengths = [n - 1 for n in rows_of.lengths]  # the token out again
        identical &= torch.equal(logits[True], logits[False])
    use(eager=False)
    eager_ms, scripted_ms = (statistics.median(seconds[kind]) * 1e3 for kind in (True, False))
    return {"rows": rows, "eager_ms": eager_ms, "scripted_ms": scripted_ms, "speedup": eager_ms / scripted_ms,
            "same_logits": identical}


def main() -> None:
    args, model = parse_and_load(__doc__.splitlines()[0], 40, RESULTS / "scripted.json")
    print(f"{'rows':>5} {'eager ms':>9} {'scripted ms':>12} {'speedup':>8} {'same logits':>12}")
    levels = []
    for rows in args.rows:
        levels.append(measure(model, rows, args.context, args.steps))
        level = levels[-1]
        print(f"{rows:>5} {level['eager_ms']:>9.1f} {level['scripted_ms']:>12.1f} {level['speedup']:>7.2f}x "
              f"{level['same_logits']!s:>12}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": {"context": args.context, "steps": args.steps, "threads": args.threads,
                                              "cpu_capability": torch.backends.cpu.get_cpu_capability()},
                                    "levels": levels}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
