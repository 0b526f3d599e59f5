"""What TorchScript gains the int8 decode step (worker/weights/scripted.py): the same functions run eagerly, by Python,
and scripted, taking turns step by step in one process over the same cache (each step's token is taken back
out of the cache, so that both see the same context), with the logits of each pair compared bit for bit.
Prints the median step of each and their ratio per batch size; writes bench/results/scripted-<host kind>.json.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.decode_step import parse_and_load, take_turns, write_levels  # noqa: E402
from worker.weights import scripted  # noqa: E402
from worker.weights.quant import use_native  # noqa: E402

COMPILED = {name: getattr(scripted, name) for name in scripted.PLAIN}


def use(eager: bool) -> None:
    """Point the module's names (which quant.py, cache.py and the plain functions themselves call) at one kind."""
    for name, function in (scripted.PLAIN if eager else COMPILED).items():
        setattr(scripted, name, function)


def measure(model: torch.nn.Module, rows: int, context: int, steps: int) -> dict:
    seconds, pairs = take_turns(model, rows, context, steps, lambda compiled: use(eager=not compiled))
    identical = all(torch.equal(p[True], p[False]) for p in pairs)
    eager_ms, scripted_ms = (statistics.median(seconds[kind]) * 1e3 for kind in (False, True))
    return {"rows": rows, "eager_ms": eager_ms, "scripted_ms": scripted_ms, "speedup": eager_ms / scripted_ms,
            "same_logits": identical}


def main() -> None:
    args, model = parse_and_load(__doc__.splitlines()[0], 40, "scripted")
    use_native(model, False)  # the layer of worker/weights/scripted.py, not worker/weights/native.cpp's kernels
    print(f"{'rows':>5} {'eager ms':>9} {'scripted ms':>12} {'speedup':>8} {'same logits':>12}")
    levels = []
    for rows in args.rows:
        levels.append(measure(model, rows, args.context, args.steps))
        level = levels[-1]
        print(f"{rows:>5} {level['eager_ms']:>9.1f} {level['scripted_ms']:>12.1f} {level['speedup']:>7.2f}x "
              f"{level['same_logits']!s:>12}", flush=True)
    write_levels(args, levels)


if __name__ == "__main__":
    main()
