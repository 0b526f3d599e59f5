"""Cost of tracing and metrics on tokens/s (issue 5): the same 16 greedy streams
through a stack with tracing on and one with it off, alternating in one run; and
the per-token cost of the metric updates on the hot paths, timed in-process."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from bench.stack_throughput import PROMPTS, stack_round  # noqa: E402
from gateway import metrics as gateway_metrics  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from worker import metrics as worker_metrics  # noqa: E402


def metric_cost_per_token_us() -> float:
    """What the gateway and the worker do per delivered token for metrics (both processes)."""
    throughput = gateway_metrics.Throughput()

    def per_token() -> None:
        gateway_metrics.ITL.observe(0.05)
        gateway_metrics.TOKENS_OUT.inc()
        throughput.add(1)
        worker_metrics.TOKENS.inc()

    runs = 200_000
    return timeit.timeit(per_token, number=runs) / runs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    started = provenance()
    rates: dict[str, list[float]] = {"traced": [], "untraced": []}
    for _ in range(args.rounds):
        for name, ttl in (("traced", "600"), ("untraced", "0")):
            with private_stack(1, TRACE_TTL=ttl, WORKER_THREADS="2", LOG_LEVEL="WARNING") as running:
                stack_round(running.url, PROMPTS[:2], 8, 2)  # warm-up
                rates[name].append(stack_round(running.url, PROMPTS, args.new_tokens, 16)["output_tok_s"])
                print(name, f"{rates[name][-1]:.1f} tok/s", flush=True)
    traced, untraced = statistics.median(rates["traced"]), statistics.median(rates["untraced"])
    cost_us = metric_cost_per_token_us()
    result = {"traced_tok_s_median": traced, "untraced_tok_s_median": untraced,
              "traced_over_untraced": traced / untraced, "rounds": rates, "metrics_cost_per_token_us": cost_us,
              "metrics_share_of_cpu_at_traced_rate": cost_us * 1e-6 * traced}
    write_results("telemetry_overhead", started, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
