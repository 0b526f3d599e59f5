"""What the compiled kernels gain the int8 decode step (worker/weights/native.cpp): the layers with and without them,
taking turns step by step in one process over the same cache (each step's token is taken back out of the
cache, so that both see the same context). Their logits differ by float rounding, so each pair is compared by
cosine and by the chosen token. Prints the median step of each and their ratio per batch size; writes
bench/results/native-<host kind>.json.

With --calls, first what one call costs beyond its arithmetic: a tiny int8 product (16 x 16) through fbgemm's op
with the packed weights passed as the ScriptObject they are, and through worker/weights/native.cpp's int8_linear with
their number (through torch.ops, and through the C++ function itself: worker/weights/native.py's `ops`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.decode_step import parse_and_load, take_turns, write_levels  # noqa: E402
from worker.weights import native  # noqa: E402
from worker.weights.quant import Int8Linear, use_native  # noqa: E402
from worker.weights.scripted import ACT_MAX, ACT_ZERO_POINT  # noqa: E402


def per_call_us(call: Callable[[], object], calls: int = 5000) -> float:
    """Median microseconds of `call`, over 5 runs of `calls / 5`."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            call()
        runs.append((time.perf_counter() - start) / (calls // 5))
    return statistics.median(runs) * 1e6


def call_costs() -> dict:
    layer = Int8Linear(torch.nn.Linear(16, 16, bias=False), native=True)
    x = torch.rand(1, 16) * 2 - 1
    fbgemm = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default._op
    costs = {"fbgemm_op_packed_object_us": per_call_us(lambda: fbgemm(x, 1 / ACT_MAX, ACT_ZERO_POINT, layer.packed)),
             "native_number_torch_ops_us": per_call_us(lambda: torch.ops.llmserve.int8_linear(x, layer.weight, None,
                                                                                              None)),
             "native_number_function_us": per_call_us(lambda: native.ops.int8_linear(x, layer.weight, None, None))}
    for name, us in costs.items():
        print(f"{name:>28}: {us:6.2f} us a call")
    return costs


def measure(model: torch.nn.Module, rows: int, context: int, steps: int) -> dict:
    seconds, pairs = take_turns(model, rows, context, steps, lambda on: use_native(model, on))
    cosines = [torch.nn.functional.cosine_similarity(p[True], p[False], dim=-1).min().item() for p in pairs]
    same_tokens = sum(int((p[True].argmax(-1) == p[False].argmax(-1)).sum()) for p in pairs)
    scripted_ms, native_ms = (statistics.median(seconds[kind]) * 1e3 for kind in (False, True))
    return {"rows": rows, "scripted_ms": scripted_ms, "native_ms": native_ms, "speedup": scripted_ms / native_ms,
            "min_cosine": min(cosines), "same_token_share": same_tokens / (rows * len(pairs))}


def main() -> None:
    args, model = parse_and_load(__doc__.splitlines()[0], 40, "native", calls=True)
    if not model.model.layers[0].native:
        sys.exit("worker/weights/native.cpp did not build here (see the worker's warning); nothing to compare")
    costs = call_costs() if args.calls else None
    print(f"{'rows':>5} {'scripted ms':>12} {'native ms':>10} {'speedup':>8} {'min cosine':>11} {'same token':>11}")
    levels = []
    for rows in args.rows:
        levels.append(measure(model, rows, args.context, args.steps))
        level = levels[-1]
        print(f"{rows:>5} {level['scripted_ms']:>12.1f} {level['native_ms']:>10.1f} {level['speedup']:>7.2f}x "
              f"{level['min_cosine']:>11.5f} {level['same_token_share']:>10.0%}", flush=True)
    write_levels(args, levels, calls=costs)


if __name__ == "__main__":
    main()
