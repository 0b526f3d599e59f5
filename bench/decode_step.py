"""Where an int8 decode step's time goes: the int8 kernel calls inside the step, against the whole step.

A decode step reads every int8 weight once, and every row's float32 keys and values. This bench times the
step of the default model (the worker's own forward, worker/own/forward.py) at a few batch sizes, and inside it
the time spent in fbgemm's int8 calls (by torch's profiler, over separate steps), then the host's memory
read bandwidth (a sum over a buffer much larger than the caches). The kernels' share bounds what a leaner
forward could gain; the bytes read over the bandwidth bound what any forward of these weights and this cache
could reach on this host. Prints one row per batch size; writes bench/results/decode_step-<host kind>.json
(decode_step_ctx<N>-... at another --context).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import worker.weights.quant as quant  # noqa: E402
from bench.provenance import provenance, write_results  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.own.cache import new_cache  # noqa: E402
from worker.own.forward import Part, forward_parts  # noqa: E402
from worker.own.model import load_model  # noqa: E402

KERNEL = "quantized::linear_with_input_q_dq_qweight_dq_output_fp32"


def kernel_seconds(step: Callable[[], object], steps: int) -> float:
    """Median seconds per step spent inside fbgemm's int8 calls, by torch's profiler (the calls are made from
    TorchScript, worker/weights/scripted.py, where Python cannot wrap them)."""
    per_step = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        per_step.append(sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == KERNEL) / 1e6)
    return statistics.median(per_step)


def int8_weight_bytes(model: torch.nn.Module) -> int:
    """The int8 weights one decode step reads (fbgemm's packed copies, one byte per weight)."""
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, quant.Int8Linear))


def read_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second of a sum over a float32 buffer far larger than the caches, median of 5."""
    buffer = torch.ones(megabytes << 18)
    buffer.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times)


def prefilled(model: torch.nn.Module, rows: int, context: int) -> DynamicCache:
    """A ragged cache of `rows` rows, each `context` random tokens prefilled."""
    cache = new_cache(model.config, ragged=True)
    ids = torch.randint(100, 1000, (rows, context))
    forward_parts(model, [Part(ids, torch.arange(context).expand(rows, context), cache)])
    return cache


@torch.inference_mode()
def take_turns(model: torch.nn.Module, rows: int, context: int, steps: int,
               switch: Callable[[bool], None]) -> tuple[dict[bool, list[float]], list[dict[bool, torch.Tensor]]]:
    """The decode step run both ways (`switch(True)`, `switch(False)`), taking turns step by step over one cache
    of `rows` rows (each step's token taken back out, so that both see the same context), who goes first
    alternating; returns each way's step seconds (past two warm-up steps) and each step's pair of logits.
    Leaves the model switched to True."""
    cache = prefilled(model, rows, context)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    pairs = []
    for step in range(steps + 2):
        tokens = torch.randint(100, 1000, (rows, 1))
        logits = {}
        for way in (step % 2 == 0, step % 2 == 1):
            switch(way)
            start = time.perf_counter()
            logits[way] = forward_parts(model, [Part(tokens, torch.full((rows, 1), context), cache)])[0]
            if step >= 2:
                seconds[way].append(time.perf_counter() - start)
            held = cache.layers[0].rows
            held.lengths = [n - 1 for n in held.lengths]  # the token out again
        pairs.append(logits)
    switch(True)
    return seconds, pairs


def write_levels(args: argparse.Namespace, levels: list[dict], **extra: object) -> None:
    """A decode bench's results, with its setup (and `extra` results, where not None), to args.out or to its
    benchmark's file."""
    result = {"setup": {"context": args.context, "steps": args.steps, "threads": args.threads,
                        "cpu_capability": torch.backends.cpu.get_cpu_capability()},
              **{k: v for k, v in extra.items() if v is not None}, "levels": levels}
    print(f"wrote {write_results(args.benchmark, args.started, result, args.out)}")


def parse_and_load(description: str, steps: int, benchmark: str,
                   calls: bool = False) -> tuple[argparse.Namespace, torch.nn.Module]:
    """The decode benches' arguments (with `calls`, a --calls flag too), and the default model loaded with their
    thread count. A run at another --context than 64 is a benchmark of its own (`<benchmark>_ctx<N>`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--context", type=int, default=64, help="tokens already in each row's cache")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help=f"default: bench/results/{benchmark}-<host kind>.json")
    if calls:
        parser.add_argument("--calls", action="store_true", help="first, what one kernel call costs beyond its work")
    args = parser.parse_args()
    args.started = provenance()
    args.benchmark = benchmark if args.context == 64 else f"{benchmark}_ctx{args.context}"
    torch.set_num_threads(args.threads)
    return args, load_model(Settings(worker_threads=args.threads)).model


@torch.inference_mode()
def measure(model: torch.nn.Module, rows: int, context: int, steps: int) -> dict:
    cache = prefilled(model, rows, context)
    position = context

    def step() -> None:
        nonlocal position
        forward_parts(model, [Part(torch.randint(100, 1000, (rows, 1)), torch.full((rows, 1), position), cache)])
        position += 1

    step_times = []
    for index in range(steps + 3):  # the first three warm up
        start = time.perf_counter()
        step()
        if index >= 3:
            step_times.append(time.perf_counter() - start)
    step_ms = statistics.median(step_times) * 1e3
    # The same fbgemm kernels, timed in the scripted layer: worker/weights/native.cpp calls them past the profiler.
    native = model.model.layers[0].native
    quant.use_native(model, False)
    try:
        kernel_ms = kernel_seconds(step, 10) * 1e3
    finally:
        quant.use_native(model, native)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    held = context + 3 + steps // 2  # the tokens each row's cache holds at the median step
    kv_bytes = 2 * rows * held * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    return {"rows": rows, "step_ms": step_ms, "int8_kernel_ms": kernel_ms, "kernel_share": kernel_ms / step_ms,
            "tokens_per_s": rows * 1e3 / step_ms, "kv_cache_bytes": kv_bytes}


def main() -> None:
    args, model = parse_and_load(__doc__.splitlines()[0], 30, "decode_step")
    levels = [measure(model, rows, args.context, args.steps) for rows in args.rows]
    weights, bandwidth = int8_weight_bytes(model), read_bandwidth()
    print(f"int8 weights read per step: {weights / 1e6:.0f} MB; host read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'rows':>5} {'step ms':>8} {'int8 kernels ms':>16} {'share':>6} {'tok/s':>7} {'KV cache MB':>12} "
          f"{'floor ms':>9}")
    for level in levels:
        level["floor_ms"] = (weights + level["kv_cache_bytes"]) / bandwidth * 1e3  # weights and cache read once
        print(f"{level['rows']:>5} {level['step_ms']:>8.1f} {level['int8_kernel_ms']:>16.1f} "
              f"{level['kernel_share']:>6.2f} {level['tokens_per_s']:>7.1f} {level['kv_cache_bytes'] / 1e6:>12.0f} "
              f"{level['floor_ms']:>9.1f}")
    first = levels[0]
    if first["rows"] == 1:
        print(f"batch 1: {1e3 / first['step_ms']:.1f} tok/s now; with nothing but the int8 kernels "
              f"{1e3 / first['int8_kernel_ms']:.1f}; at the bandwidth floor {1e3 / first['floor_ms']:.1f}")
    write_levels(args, levels, int8_weight_bytes=weights, read_bandwidth_bytes_per_s=bandwidth)


if __name__ == "__main__":
    main()
