"""The decode step of GGUF files whose matrices are 5-bit (Q5_0, Q5_1, Q5_K, as Q4_K_M and Q5_K_M files hold them)
on the Q5_1 blocks, against the same file with those matrices quantized again to Q8_0 (what the loader did before
it had the 5-bit blocks), taking turns step by step in one process (bench/blocks.py's measure). Prints each
one's median step, their ratio and the weight bytes a step reads, per file and batch size; writes
bench/results/five_bit-<host kind>.json.

    python bench/five_bit.py --files ~/.cache/llmserve/user-models/smollm2-135m-Q4_K_M/model.gguf ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.blocks import measure, weight_bytes  # noqa: E402
from bench.provenance import provenance, write_results  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.own.model import load_model  # noqa: E402
from worker.weights import transcode  # noqa: E402


def eight_bit_target(kinds) -> transcode.T:
    """The loader's choice before the 5-bit blocks: 4-bit parts as Q4_1, anything else as Q8_0."""
    return transcode.Q4_1 if all(kind in transcode.FOUR_BIT for kind in kinds) else transcode.Q8_0


def load(path: Path, threads: int) -> torch.nn.Module:
    return load_model(Settings(worker_threads=threads, model=str(path.parent), model_file=path.name)).model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=Path, nargs="+", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    started = provenance()
    torch.set_num_threads(args.threads)
    results = {}
    for path in args.files:
        name = path.parent.name if path.name == "model.gguf" else path.stem
        with mock.patch.object(transcode, "target", eight_bit_target):
            eight = load(path, args.threads)
        models = {"q5_1": load(path, args.threads), "q8_0": eight}
        sizes = {kind: weight_bytes(model) for kind, model in models.items()}
        print(f"{name}: weights read per step {sizes['q5_1'] / 1e6:.1f} MB on Q5_1 blocks, "
              f"{sizes['q8_0'] / 1e6:.1f} MB with those as Q8_0")
        levels = []
        for rows in args.rows:
            level = measure(models, rows, args.context, args.steps)
            levels.append(level)
            print(f"  rows {rows:>3}: {level['q5_1_ms']:.1f} ms against {level['q8_0_ms']:.1f} ms, "
                  f"{level['speedup']:.2f}x, same token {level['same_token_share']:.0%}", flush=True)
        results[name] = {"weight_bytes": sizes, "levels": levels}
        del models, eight
    setup = {"context": args.context, "steps": args.steps, "threads": args.threads}
    print(f"wrote {write_results('five_bit', started, {'setup': setup, 'files': results})}")


if __name__ == "__main__":
    main()
