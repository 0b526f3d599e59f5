"""The own engine's decode step on a GPU with cuDNN's attention off (the worker's default) and on, taking turns
off, on, off in one process: cuDNN plans a graph for each new shape, and a decode step's keys grow by one every
step. Run on a GPU host the way bench/cuda.sh sets up (ENGINE=hf, WORKER_DEVICE=cuda, WORKER_QUANT=none); prints
each step's median and writes bench/results/cuda_attention-<host kind>.json.

    python bench/cuda_attention.py [--rows 1 64 256] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.cuda_engine import started_record  # noqa: E402
from bench.provenance import write_results  # noqa: E402
from common.protocol import ChatMessage, SamplingParams, Submit  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.own.engine import Engine  # noqa: E402
from worker.own.model import LoadedModel, load_model  # noqa: E402

PARAMS = SamplingParams(max_tokens=64, temperature=0, top_p=1, top_k=0, ignore_eos=True)


def step_ms(loaded: LoadedModel, prompt: list[int], rows: int, steps: int) -> float:
    """The median decode step of `rows` streams of `prompt`, after their prefill and a few warm steps."""
    engine = Engine(loaded, max(rows, 1))
    for i in range(rows):
        engine.add(f"r{i}", prompt, PARAMS)
    for _ in range(6):
        engine.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    started = started_record()
    loaded = load_model(Settings.from_env())
    if loaded.device.type != "cuda":
        sys.exit("bench/cuda_attention.py needs a GPU (WORKER_DEVICE=cuda)")
    prompt = loaded.prompt_ids(Submit("c", PARAMS, messages=[ChatMessage("user", "Describe Paris in JSON.")]))
    turns = []
    for cudnn in (False, True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        turn = {"cudnn_attention": cudnn, "step_ms_p50": {}}
        for rows in args.rows:
            turn["step_ms_p50"][str(rows)] = ms = step_ms(loaded, prompt, rows, args.steps)
            print(f"cuDNN attention {'on ' if cudnn else 'off'}: {rows:>4} rows, step p50 {ms:.2f} ms", flush=True)
        turns.append(turn)
    torch.backends.cuda.enable_cudnn_sdp(False)
    off = {rows: statistics.median(t["step_ms_p50"][rows] for t in turns if not t["cudnn_attention"])
           for rows in turns[0]["step_ms_p50"]}
    on = turns[1]["step_ms_p50"]
    result = {"setup": {"rows": args.rows, "steps": args.steps, "prompt_tokens": len(prompt),
                        "params": "greedy, 64 new tokens, ignore_eos"},
              "turns": turns, "off_over_on": {rows: on[rows] / off[rows] for rows in off}}
    print("cuDNN on / off:", ", ".join(f"{rows} rows {ratio:.2f}x" for rows, ratio in result["off_over_on"].items()))
    print(f"wrote {write_results('cuda_attention', started, result)}")


if __name__ == "__main__":
    main()
