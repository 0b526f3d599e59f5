"""Issue 12, target 4: perplexity of the default model in float32, on its GGUF file's own blocks (the CPU
worker's default, worker/weights/blocks.py) and in int8 (worker/weights/quant.py), on English text that ships
with the Python install itself: the Language Reference's topics in `pydoc_data/topics.py` (what
`help("assert")` prints), in sorted order, joined by blank lines.

As llama.cpp's `llama-perplexity`: the tokens are cut into windows of 512, each window is one forward from
an empty context, and the log-likelihood of each token given the window's tokens before it is scored two
ways: every token of the window after the first ("both halves") and only the second half (tokens 256..511,
each with at least 256 tokens of context, llama-perplexity's own figure). Also, as its `--kl-divergence`
mode: the mean KL divergence of each quantised model's next-token distribution from float32's, and how often
both rank the same token first (second halves). All models see the same windows; the tokenizer adds no BOS to
plain text.
A third model, int8 without the rotation of worker/weights/rotation.py, shows that change's part.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.own.model import LoadedModel, load_model  # noqa: E402
from worker.prompts import bundled_gguf  # noqa: E402
from worker.weights.quant import quantize_int8  # noqa: E402

WINDOW = 512


def corpus() -> tuple[str, str]:
    """The text and where it comes from."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics)), topics.__file__


@torch.inference_mode()
def log_probs(loaded: LoadedModel, window: list[int]) -> torch.Tensor:
    """[WINDOW - 1, vocab]: the log-distribution of each next token given the window before it."""
    logits = loaded.model(input_ids=torch.tensor([window])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def peer(binary: str, gguf: Path, text: str, windows: int, threads: int) -> dict[str, object]:
    """llama-perplexity on the GGUF file the float32 model is dequantised from, same windows."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as corpus_file:
        corpus_file.write(text)
        corpus_file.flush()
        run = subprocess.run([binary, "-m", str(gguf), "-f", corpus_file.name, "-c", str(WINDOW), "-t", str(threads),
                              "--chunks", str(windows)], capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if found is None:
        raise RuntimeError(f"no estimate in llama-perplexity's output: {run.stderr[-500:]}")
    return {"second_half": float(found.group(1)), "binary": binary, "file": gguf.name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=0, help="windows of 512 tokens scored (0: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-perplexity", metavar="BIN",
                        help="also run llama.cpp's llama-perplexity on the same text and GGUF file")
    parser.add_argument("--model", metavar="DIR",
                        help="another GGUF file's folder (MODEL), e.g. the default model requantized by "
                             "bench/user_models.py make: float32 of that file and its blocks only, written as "
                             "perplexity_<folder>")
    parser.add_argument("--model-file", default="model.gguf", help="the file in --model (MODEL_FILE)")
    args = parser.parse_args()
    provenance_at_start = provenance()

    text, source = corpus()
    where = {"model": args.model, "model_file": args.model_file} if args.model else {}
    paths = ("none", "gguf") if args.model else ("none", "gguf", "int8")
    models = {quant: load_model(Settings(worker_threads=args.threads, worker_quant=quant, **where))
              for quant in paths}
    if not args.model:
        models["int8_unrotated"] = load_model(Settings(worker_threads=args.threads, worker_quant="none"))
        quantize_int8(models["int8_unrotated"].model, rotate=False)  # the int8 path without its rotation
    ids = models["none"].tokenizer(text)["input_ids"]
    count = len(ids) // WINDOW if not args.windows else min(args.windows, len(ids) // WINDOW)
    half = WINDOW // 2
    sums = {quant: {"all": 0.0, "second_half": 0.0} for quant in models}
    quantised = [quant for quant in models if quant != "none"]
    kl, agree = dict.fromkeys(quantised, 0.0), dict.fromkeys(quantised, 0)
    seconds = {quant: 0.0 for quant in models}
    for index in range(count):
        window = ids[index * WINDOW:(index + 1) * WINDOW]
        targets = torch.tensor(window[1:])
        dists = {}
        for quant, loaded in models.items():
            started = time.perf_counter()
            dists[quant] = log_probs(loaded, window)
            seconds[quant] += time.perf_counter() - started
            chosen = -dists[quant].gather(1, targets[:, None])[:, 0].double()
            sums[quant]["all"] += float(chosen.sum())
            sums[quant]["second_half"] += float(chosen[half - 1:].sum())  # predictions of tokens half..WINDOW-1
        reference = dists["none"][half - 1:]
        for quant in quantised:
            other = dists[quant][half - 1:]
            kl[quant] += float((reference.exp() * (reference - other)).sum(dim=-1).double().sum())
            agree[quant] += int((reference.argmax(-1) == other.argmax(-1)).sum())
        if (index + 1) % 16 == 0:
            print(f"{index + 1}/{count} windows", flush=True)
    scored = {"all": count * (WINDOW - 1), "second_half": count * half}
    perplexity = {quant: {part: math.exp(total / scored[part]) for part, total in parts.items()}
                  for quant, parts in sums.items()}
    result = {
        "setup": {"source": source, "characters": len(text), "tokens": len(ids), "window": WINDOW,
                  "windows": count, "threads": args.threads, "model": Path(args.model).name if args.model
                  else Settings().model},
        "perplexity": {("float32" if quant == "none" else quant): value for quant, value in perplexity.items()},
        "over_float32": {quant: {part: perplexity[quant][part] / perplexity["none"][part] for part in scored}
                         for quant in kl},
        "second_half_mean_kl_divergence": {quant: total / scored["second_half"] for quant, total in kl.items()},
        "second_half_same_top_token": {quant: same / scored["second_half"] for quant, same in agree.items()},
        "seconds_per_window": {("float32" if quant == "none" else quant): total / count
                               for quant, total in seconds.items()},
    }
    if args.llama_perplexity:
        gguf = Path(args.model, args.model_file) if args.model else Path(bundled_gguf())
        result["llama_perplexity"] = peer(args.llama_perplexity, gguf, text, count, args.threads)
        result["over_float32"]["llama_perplexity"] = {
            "second_half": result["llama_perplexity"]["second_half"] / perplexity["none"]["second_half"]}
    name = f"perplexity_{Path(args.model).name.lower().replace('-', '_')}" if args.model else "perplexity"
    write_results(name, provenance_at_start, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
