"""Control-plane scaling with ENGINE=sim workers (a first look for issue 6): output
tokens/s through one gateway with 1, 2, 4 and 8 workers at a fixed step time,
16 streams per worker, against the engines' own limit."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stack_throughput import stack_round  # noqa: E402
from llmserve.launcher import private_stack  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--per-seq-ms", type=float, default=0.5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    slots = 16
    limit_per_worker = slots / ((args.step_ms + args.per_seq_ms * slots) / 1000)
    rows = []
    for workers in args.workers:
        settings = {"ENGINE": "sim", "SIM_STEP_MS": str(args.step_ms), "SIM_STEP_PER_SEQ_MS": str(args.per_seq_ms),
                    "WORKER_SLOTS": str(slots), "LOG_LEVEL": "WARNING"}
        with private_stack(workers, **settings) as running:
            prompts = [f"stream {i}" for i in range(slots * workers)]
            result = asyncio.run(stack_round(running.url, prompts, args.new_tokens, len(prompts)))
        linear = limit_per_worker * workers
        rows.append({"workers": workers, "streams": len(prompts), "tok_s": result["tok_s"],
                     "engine_limit_tok_s": linear, "of_limit": result["tok_s"] / linear})
        print(json.dumps(rows[-1]), flush=True)
    out = {"step_ms": args.step_ms, "per_seq_ms": args.per_seq_ms, "slots": slots, "rows": rows,
           "scaling_vs_1_worker": [r["tok_s"] / rows[0]["tok_s"] for r in rows]}
    (ROOT / "bench" / "results" / "sim_scaling.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
