"""Sweep a server through load levels and report each: the body of `llmserve bench`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from llmserve.loadgen.client import Outcome, Sampling, Target, stream
from llmserve.loadgen.plot import plot_sweeps
from llmserve.loadgen.stats import summarize
from llmserve.loadgen.workload import Job, Lengths, arrival_offsets, make_jobs


class Progress:
    """A one-line bar on stderr, redrawn at most four times a second."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.tokens, self.failed = label, total, 0, 0, 0
        self.start = self.drawn = time.perf_counter()
        self.live = sys.stderr.isatty()  # a log file gets the last state only, not a line per redraw

    def update(self, outcome: Outcome) -> None:
        self.done += 1
        self.tokens += outcome.tokens
        self.failed += not outcome.ok
        now = time.perf_counter()
        if (self.live and now - self.drawn > 0.25) or self.done == self.total:
            self.drawn = now
            filled = 30 * self.done // self.total
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"requests, {self.tokens} tokens, {self.failed} failed, {now - self.start:.1f} s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


@dataclass(frozen=True)
class Level:
    """One load level: at most `concurrency` requests in flight; with a `rate`, Poisson arrivals."""

    concurrency: int | None
    rate: float | None

    @property
    def kind(self) -> str:
        return "request rate (req/s)" if self.rate else "concurrency"

    @property
    def value(self) -> float:
        return self.rate or self.concurrency or 0


async def run_level(target: Target, jobs: list[Job], sampling: Sampling, level: Level, seed: int = 0,
                    show_progress: bool = True) -> dict[str, object]:
    offsets = arrival_offsets(len(jobs), level.rate, seed)
    gate = asyncio.Semaphore(level.concurrency or len(jobs))
    progress = Progress(f"{level.kind} {level.value:g}", len(jobs)) if show_progress else None
    start = time.perf_counter()

    async def one(job: Job, offset: float) -> Outcome:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with gate:
            outcome = await stream(target, job, sampling)
        if progress:
            progress.update(outcome)
        return outcome

    outcomes = await asyncio.gather(*(one(job, offset) for job, offset in zip(jobs, offsets, strict=True)))
    summary = summarize(outcomes, time.perf_counter() - start)
    return {"load": level.value, "load_kind": level.kind, "concurrency": level.concurrency, "rate": level.rate,
            **summary}


def discover_model(target: Target) -> str:
    """The first model the server lists, as OpenAI clients do when none is named."""
    request = urllib.request.Request(target.url.rstrip("/") + "/v1/models")
    if target.api_key:
        request.add_header("Authorization", f"Bearer {target.api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_row(level: dict) -> str:
    return (f"{level['load']:>8g} {level['request_throughput']:>7.2f} {level['output_tok_s']:>9.1f} "
            f"{_ms(level['ttft_s']['p50']):>8} {_ms(level['ttft_s']['p99']):>8} {_ms(level['itl_s']['p50']):>7} "
            f"{_ms(level['itl_s']['p99']):>7} {_ms(level['e2e_s']['p50']):>8} {_ms(level['e2e_s']['p99']):>8} "
            f"{level['failed']:>6}")


HEADER = (f"{'load':>8} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>7} "
          f"{'ITL p99':>7} {'E2E p50':>8} {'E2E p99':>8} {'failed':>6}   (times in ms)")


async def sweep(target: Target, levels: list[Level], requests: int, prompt_lengths: Lengths,
                output_lengths: Lengths, sampling: Sampling, seed: int = 0, warmup: int = 0,
                show_progress: bool = True, shared_tokens: int = 0) -> list[dict]:
    """Every level gets the same workload; the warm-up requests are not counted (nor do they share the
    workload's shared text: they warm the server, not its prefix cache)."""
    if warmup:
        warm = make_jobs(warmup, prompt_lengths, Lengths("fixed", 8), seed + 99, shared_tokens)
        await run_level(target, warm, sampling, Level(warmup, None), show_progress=False)
    jobs = make_jobs(requests, prompt_lengths, output_lengths, seed, shared_tokens)
    results = []
    for level in levels:
        results.append(await run_level(target, jobs, sampling, level, seed, show_progress))
        if show_progress:
            print(format_row(results[-1]), flush=True)
            for error in results[-1]["errors"]:
                print(f"  failed: {error}", flush=True)
    return results


def _numbers(text: str, kind: type) -> list:
    return [kind(part) for part in text.split(",") if part]


def _lengths(text: str) -> Lengths:
    try:
        return Lengths.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://localhost:8000", help="the server (default %(default)s)")
    parser.add_argument("--api", choices=("openai", "chat", "native"), default="openai",
                        help="openai: /v1/completions on any compatible server; chat: /v1/chat/completions; "
                             "native: llmserve's /generate_stream")
    parser.add_argument("--model", default="", help="model name for the openai API (default: the first listed)")
    parser.add_argument("--api-key", default="", help="sent as a bearer token")
    parser.add_argument("--concurrency", default="", help="requests in flight, or a comma list to sweep (e.g. 1,4,16)")
    parser.add_argument("--rate", default="", help="Poisson arrivals per second, or a comma list to sweep")
    parser.add_argument("--requests", type=int, default=64, help="requests per load level (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=_lengths, default=Lengths("fixed", 32),
                        help="prompt length: N, uniform:LOW:HIGH or normal:MEAN:SD (default 32)")
    parser.add_argument("--output-tokens", type=_lengths, default=Lengths("fixed", 64),
                        help="new tokens per request, same forms (default 64)")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="every prompt starts with one shared text of about this many tokens (the system "
                             "message with --api chat), then its own --prompt-tokens: a shared-prefix workload")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests end at EOS instead of producing exactly their output length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests first (default %(default)s)")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument("--plot", default="", help="write a PNG of latency and throughput against load here")


def main(args: argparse.Namespace) -> int:
    concurrencies, rates = _numbers(args.concurrency, int), _numbers(args.rate, float)
    if rates:
        levels = [Level(concurrencies[0] if concurrencies else None, rate) for rate in rates]
    else:
        levels = [Level(c, None) for c in concurrencies or [1]]
    if any(level.value <= 0 for level in levels) or args.requests < 1:
        raise SystemExit("llmserve bench: concurrency, rate and requests must be positive")
    target = Target(args.url, args.api, args.model, args.api_key)
    if args.api != "native" and not args.model:
        try:
            target = Target(args.url, args.api, discover_model(target), args.api_key)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise SystemExit(f"llmserve bench: no model listed at {args.url}/v1/models ({exc}); pass --model") from None
    sampling = Sampling(args.temperature, args.top_p, args.sampling_seed, args.ignore_eos)
    shared = f" after {args.shared_prefix_tokens} shared" if args.shared_prefix_tokens else ""
    print(f"{target.url} ({target.api}{', ' + target.model if target.model else ''}): {args.requests} requests "
          f"per level, prompt {args.prompt_tokens} tokens{shared}, output {args.output_tokens} tokens")
    print(HEADER)
    results = asyncio.run(sweep(target, levels, args.requests, args.prompt_tokens, args.output_tokens, sampling,
                                args.seed, args.warmup, shared_tokens=args.shared_prefix_tokens))
    setup = {"url": target.url, "api": target.api, "model": target.model, "requests": args.requests,
             "prompt_tokens": str(args.prompt_tokens), "shared_prefix_tokens": args.shared_prefix_tokens,
             "output_tokens": str(args.output_tokens),
             "sampling": asdict(sampling), "seed": args.seed}
    if args.out:
        Path(args.out).write_text(json.dumps({"setup": setup, "levels": results}, indent=2) + "\n")
    if args.plot:
        plot_sweeps({f"{target.url} ({target.api})": results}, args.plot, title=str(args.output_tokens))
    return 1 if any(level["failed"] for level in results) else 0
