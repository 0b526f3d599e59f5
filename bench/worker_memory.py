"""Where an own-engine worker's memory goes (issue 44's memory target): the resident memory (RSS: anonymous and
file-backed) and its peak after each stage of a worker's start, in a fresh process per file: Python, torch, the
engine's modules (transformers' model code with them), the tokenizer, the model on its weights path, the engine
(its prefix cache bound included), one request answered.

    python bench/worker_memory.py                         # the shipped file
    python bench/worker_memory.py --files DIR/model.gguf  # and the files users bring (bench/user_models.py make)

Writes bench/results/worker_memory-<host kind>.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.memory import memory_mb  # noqa: E402
from bench.provenance import provenance, write_results  # noqa: E402


def stages() -> None:
    """In the child: each stage, then its memory, as one JSON line."""
    def report(stage: str) -> None:
        print(json.dumps({"stage": stage, **{k: round(v) for k, v in memory_mb().items()}}), flush=True)

    report("python")
    import torch  # noqa: F401
    report("torch")
    from common.protocol import SamplingParams
    from common.settings import Settings
    from worker.engines import own_engine
    from worker.own.model import load_model
    report("engine modules")
    settings = Settings.from_env()
    from transformers import AutoTokenizer

    from worker.prompts import source
    path, extra = source(settings)
    AutoTokenizer.from_pretrained(path, **extra)
    report("tokenizer")
    loaded = load_model(settings)
    report(f"model ({loaded.weights})")
    _, engine = own_engine(settings, loaded)
    report("engine")
    engine.add("one", loaded.tokenizer("Tell me about the sea.")["input_ids"],
               SamplingParams(max_tokens=16, temperature=0))
    while engine.has_work():
        engine.step()
    report("one request")


def measure(gguf: Path | None, threads: int) -> list[dict]:
    env = {**os.environ, "WORKER_THREADS": str(threads), "ENGINE": "hf"}
    if gguf is not None:
        env |= {"MODEL": str(gguf.parent), "MODEL_FILE": gguf.name}
    out = subprocess.run([sys.executable, __file__, "--stages"], env=env, check=True, capture_output=True,
                         text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="*", default=[], help="GGUF files besides the shipped one")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.stages:
        stages()
        return
    started = provenance()
    results = {}
    for gguf in [None, *map(Path, args.files)]:
        name = "shipped" if gguf is None else gguf.parent.name
        results[name] = {"file_mb": round(gguf.stat().st_size / 1e6) if gguf else None,
                         "stages": measure(gguf, args.threads)}
        print(name)
        for row in results[name]["stages"]:
            print(f"  {row['stage']:22} RSS {row['rss']:6} MB (anonymous {row['anonymous']}, file {row['file']}), "
                  f"peak {row['peak']}", flush=True)
    print(write_results("worker_memory", started, {"threads": args.threads, "files": results}, args.out))


if __name__ == "__main__":
    main()
