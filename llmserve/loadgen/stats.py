"""From timed outcomes to the figures serving benchmarks report."""

from __future__ import annotations

import itertools
import statistics

from llmserve.loadgen.client import Outcome


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def describe(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": statistics.fmean(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def summarize(outcomes: list[Outcome], duration: float) -> dict[str, object]:
    """TTFT from sending to the first token; ITL between consecutive tokens of a stream; TPOT the mean
    gap of one request; end-to-end from sending to the last byte."""
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in done)
    errors = sorted({o.error or "no tokens" for o in outcomes if not o.ok})
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "errors": errors[:5],
        "duration_s": duration,
        "output_tokens": tokens,
        "request_throughput": len(done) / duration,
        "output_tok_s": tokens / duration,
        "ttft_s": describe([o.token_times[0] - o.sent for o in done]),
        "itl_s": describe([b - a for o in done for a, b in itertools.pairwise(o.token_times)]),
        "tpot_s": describe([(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1)
                            for o in done if len(o.token_times) > 1]),
        "e2e_s": describe([o.ended - o.sent for o in done]),
    }
