"""Issue 13: what structured outputs cost and what they buy, in-process on the real model.

1. The grammar's cost per decode step at batch 1 and 16: every row constrained by a JSON schema against
   every row free, taking turns; what the grammar adds to sampling and token handling (llguidance's mask per
   row, its biases on the logits, each chosen token's check) timed inside real decode steps, against the
   step's whole time.
2. The schema-valid rate: the same questions, each asking for JSON of a given schema (the schema in the
   prompt), answered constrained and unconstrained, each answer validated with jsonschema.
3. With `--compare`: llguidance against the other libraries made for this that are installed here
   (xgrammar, outlines-core): time to build a schema's matcher and per-token mask time on one answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common import grammar  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.own import engine as engine_module  # noqa: E402
from worker.own.engine import Engine  # noqa: E402
from worker.own.model import LoadedModel, load_model  # noqa: E402

# A schema that keeps rows generating for the whole measured stretch.
LONG = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 60},
                                                   "minItems": 40}}, "required": ["notes"]}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 130}},
               "required": ["name", "age"]},
    "book": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                              "year": {"type": "integer", "minimum": 0, "maximum": 2100},
                                              "genres": {"type": "array", "items": {"enum": ["fiction", "history",
                                                                                              "science", "poetry"]},
                                                         "maxItems": 3}},
             "required": ["title", "year", "genres"]},
    "weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "celsius": {"type": "number", "minimum": -60, "maximum": 60},
                                                 "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
                "required": ["city", "celsius", "sky"]},
}
TOPICS = ["Paris", "a famous scientist", "a novel about the sea", "Tokyo in winter", "a farmer", "an old library",
          "a poet", "London in spring", "a chess player", "a history of Rome"]


class MaskTimer:
    """Adds up, inside real steps, the time of the engine's sampling and its handling of each chosen token:
    all the grammar adds to a step (the masks, their biases on the logits, each token's check) is there, so
    the same time of free rows, taken away, leaves the grammar's own cost."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self, engine: Engine) -> None:
        for name in ("_sample", "_emit"):
            setattr(engine, name, self._timed(getattr(engine, name)))

    def _timed(self, method):
        def timed(*args):
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def decode_steps(loaded: LoadedModel, batch: int, constrained: bool, steps: int) -> tuple[list[float], float]:
    """Per-step seconds of `steps` decode steps at `batch` rows (after their prefill), and the seconds per step
    spent sampling and handling the chosen tokens."""
    rule = grammar.checked(grammar.json_schema(LONG)) if constrained else ""
    engine = Engine(loaded, batch)
    timer = MaskTimer()
    timer.install(engine)
    for row in range(batch):
        ids = loaded.chat_ids([{"role": "user", "content": f"Write notes about {TOPICS[row % len(TOPICS)]}."}])
        engine.add(f"r{row}", ids, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True,
                                                  grammar=rule))
    while engine.waiting or engine.prefills:
        engine.step()
    timer.seconds, times = 0.0, []
    for _ in range(steps):
        started = time.perf_counter()
        result = engine.step()
        times.append(time.perf_counter() - started)
        assert result.kind == "decode" and len(result.outputs) == batch, "a row left early"
    return times, timer.seconds / steps


def mask_cost(loaded: LoadedModel, batches: list[int], steps: int, rounds: int) -> dict:
    results = {}
    for batch in batches:
        free, held, costs = [], [], []
        for _ in range(rounds):
            times, free_sampling = decode_steps(loaded, batch, False, steps)
            free.append(statistics.median(times))
            times, held_sampling = decode_steps(loaded, batch, True, steps)
            held.append(statistics.median(times))
            costs.append(held_sampling - free_sampling)
        step_free, step_held, cost = statistics.median(free), statistics.median(held), statistics.median(costs)
        results[batch] = {"step_free_ms": step_free * 1e3, "step_constrained_ms": step_held * 1e3,
                          "grammar_ms": cost * 1e3, "grammar_share_of_step": cost / step_held}
        print(f"batch {batch:>2}: decode step free {step_free * 1e3:.1f} ms, constrained {step_held * 1e3:.1f} ms; "
              f"the grammar's own work {cost * 1e3:.2f} ms ({100 * cost / step_held:.1f}% of the step)")
    return results


def answer(loaded: LoadedModel, prompts: list[list[int]], rule: str, max_tokens: int) -> list[str]:
    engine = Engine(loaded, len(prompts))
    for i, ids in enumerate(prompts):
        engine.add(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0, grammar=rule))
    texts = [""] * len(prompts)
    while engine.has_work():
        for out in engine.step().outputs:
            texts[int(out.request_id)] += out.text
    return texts


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), grammar.closed(schema))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def valid_rate(loaded: LoadedModel, max_tokens: int) -> dict:
    results = {}
    for name, schema in SCHEMAS.items():
        prompts = [loaded.chat_ids([{"role": "user", "content": f"Answer with only a JSON object that keeps to this "
                                     f"JSON schema: {json.dumps(schema)}\nThe subject: {topic}."}])
                   for topic in TOPICS]
        free = answer(loaded, prompts, "", max_tokens)
        held = answer(loaded, prompts, grammar.checked(grammar.json_schema(schema)), max_tokens)
        results[name] = {"constrained": sum(valid(t, schema) for t in held) / len(held),
                         "unconstrained": sum(valid(t, schema) for t in free) / len(free),
                         "example_unconstrained": free[0][:200], "example_constrained": held[0][:200]}
        print(f"{name:>8}: schema-valid constrained {results[name]['constrained']:.0%}, "
              f"unconstrained {results[name]['unconstrained']:.0%} of {len(TOPICS)}")
    return results


def compare(loaded: LoadedModel) -> dict:
    """Build time and per-token mask time of each installed library, on one answer of the book schema."""
    schema = grammar.closed(SCHEMAS["book"])
    text = '{"title": "The Old Man and the Sea", "year": 1952, "genres": ["fiction"]}'
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    results = {}
    from llguidance import LLMatcher  # only for the comparison

    index = loaded.grammars.index()
    words = torch.empty(loaded.grammars.words, dtype=torch.int32)

    def llguidance_run() -> tuple[float, list[float]]:
        started = time.perf_counter()
        matcher = LLMatcher(index, grammar.json_schema(schema))
        built, masks = time.perf_counter() - started, []
        for token in ids:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            masks.append(time.perf_counter() - started)
            assert matcher.consume_token(token)
        return built, masks

    runs = {"llguidance": llguidance_run}
    try:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(loaded.tokenizer, vocab_size=loaded.vocab)
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

        def xgrammar_run() -> tuple[float, list[float]]:
            started = time.perf_counter()
            matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
            built, masks, bitmask = time.perf_counter() - started, [], xgrammar.allocate_token_bitmask(1, loaded.vocab)
            for token in ids:
                started = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                masks.append(time.perf_counter() - started)
                assert matcher.accept_token(token)
            return built, masks

        runs["xgrammar"] = xgrammar_run
    except ImportError:
        print("xgrammar: not installed")
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        vocabulary = outlines_vocabulary(loaded, outlines_core)

        def outlines_run() -> tuple[float, list[float]]:
            started = time.perf_counter()
            guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"),
                                                            vocabulary))
            built, masks = time.perf_counter() - started, []
            for token in ids:
                started = time.perf_counter()
                allowed = guide.get_tokens()
                masks.append(time.perf_counter() - started)
                assert token in allowed
                guide.advance(token)
            return built, masks

        runs["outlines-core"] = outlines_run
    except ImportError:
        print("outlines-core: not installed")
    for name, run in runs.items():
        run()  # warm
        builds, masks = [], []
        for _ in range(5):
            built, times = run()
            builds.append(built)
            masks += times
        results[name] = {"build_ms": statistics.median(builds) * 1e3, "mask_us_p50": statistics.median(masks) * 1e6,
                         "mask_us_max": max(masks) * 1e6}
        print(f"{name:>14}: build {results[name]['build_ms']:.1f} ms, mask p50 {results[name]['mask_us_p50']:.1f} us, "
              f"max {results[name]['mask_us_max']:.0f} us per token")
    return results


def outlines_vocabulary(loaded: LoadedModel, outlines_core):
    """outlines-core wants each token's text as the regex sees it: byte-level tokens decoded to their bytes."""
    eos = loaded.eos_token_ids[0]
    tokens: dict[str, list[int]] = {}
    for token_id in range(loaded.vocab):
        if token_id == eos:
            continue
        text = loaded.tokenizer.decode([token_id])
        if text and "\ufffd" not in text:
            tokens.setdefault(text, []).append(token_id)
    return outlines_core.Vocabulary(eos, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--compare", action="store_true", help="also time xgrammar and outlines-core if installed")
    args = parser.parse_args()
    started = provenance()
    loaded = load_model(Settings(worker_threads=args.threads))
    loaded.grammars.index()
    print(f"engine block {engine_module.DEFAULT_BLOCK_CPU}, {args.threads} threads")
    results = {"threads": args.threads,
               "mask_cost": mask_cost(loaded, [int(b) for b in args.batches.split(",")], args.steps, args.rounds),
               "valid_rate": valid_rate(loaded, args.max_tokens)}
    if args.compare:
        results["libraries"] = compare(loaded)
    print(f"wrote {write_results('grammar', started, results)}")


if __name__ == "__main__":
    main()
