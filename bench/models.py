"""Issue 31: several models behind one gateway.

mix: against a running stack whose workers serve two model names, N requests alternating between them;
    each answer's worker (the last dispatch hop of its trace) against the workers answering to the name it
    asked for (/v1/cluster): how many came from a worker of another model.
dispatch: ENGINE=sim stacks of 4 workers, all of one model, then 2 + 2 of two models, taking turns for
    --rounds rounds under the same load (half the streams per model in the second); output tokens/s, time to
    first token, and the scheduler's CPU seconds per 1,000 requests.

Writes bench/results/models-<host kind>.json (each part under its own key; `mix` under --label)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.control_plane import service, sim_settings  # noqa: E402
from bench.provenance import provenance, results_path, update_results  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.run import Level, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402


def mix(url: str, models: list[str], requests: int) -> dict[str, object]:
    workers = httpx.get(f"{url}/v1/cluster", timeout=10).json()["workers"]
    owners = {name: {w["id"] for w in workers if name in w.get("names", [w["model"]])} for name in models}
    asked = [models[i % len(models)] for i in range(requests)]
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=url, timeout=300) as client:
        answers = [client.post("/v1/completions", json={**body, "model": model}) for model in asked]
        wrong, failed = 0, 0
        for model, answer in zip(asked, answers, strict=True):
            if answer.status_code != 200:
                failed += 1
                continue
            trace = client.get(f"/v1/requests/{answer.headers['x-request-id']}/trace").json()
            dispatched = [e["detail"]["worker_id"] for e in trace["events"] if e["hop"] == "dispatched"]
            wrong += dispatched[-1] not in owners[model]
    return {"models": models, "requests": requests, "wrong_model_answers": wrong, "failed": failed,
            "workers": {name: sorted(ids) for name, ids in owners.items()}}


async def _load(url: str, models: list[str], streams: int, requests: int, tokens: int) -> dict:
    """`streams` at once over the models (an equal share each), `requests` in all."""
    async def one(model: str) -> dict:
        jobs = make_jobs(requests // len(models), Lengths("fixed", 8), Lengths("fixed", tokens), seed=len(model))
        return await run_level(Target(url, "openai", model), jobs, Sampling(), Level(streams // len(models), None))

    parts = await asyncio.gather(*(one(model) for model in models))
    return {"output_tok_s": sum(p["output_tok_s"] for p in parts), "failed": sum(p["failed"] for p in parts),
            "ttft_p50_ms": statistics.median(p["ttft_s"]["p50"] for p in parts) * 1000}


def dispatch_once(workers: dict[str, int], streams: int, requests: int, tokens: int, step_ms: float) -> dict:
    models = list(workers)
    with private_stack(workers, **sim_settings(step_ms, 16), NAMESPACE="bench-models") as running:
        scheduler = service(running, "scheduler")
        asyncio.run(_load(running.url, models, 16 * len(models), 16 * len(models), 4))  # warm-up
        before = scheduler.cpu_times()
        result = asyncio.run(_load(running.url, models, streams, requests, tokens))
        after = scheduler.cpu_times()
    cpu = (after.user + after.system) - (before.user + before.system)
    return {"models": len(models), **result, "scheduler_cpu_s_per_1000_requests": cpu / requests * 1000}


def dispatch(rounds: int, streams: int, requests: int, tokens: int, step_ms: float) -> dict[str, object]:
    layouts = {"one model": {"m0": 4}, "two models": {"m0": 2, "m1": 2}}
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    for _ in range(rounds):
        for name, workers in layouts.items():
            runs[name].append(dispatch_once(workers, streams, requests, tokens, step_ms))
            print(name, json.dumps(runs[name][-1]), flush=True)
    medians = {name: {key: statistics.median(run[key] for run in rows) for key in rows[0] if key != "models"}
               for name, rows in runs.items()}
    one, two = medians["one model"], medians["two models"]
    return {"step_ms": step_ms, "streams": streams, "requests": requests, "new_tokens": tokens, "runs": runs,
            "medians": medians,
            "two_over_one": {key: two[key] / one[key] for key in one if one[key]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("mix", "dispatch"))
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--models", nargs=2, default=["smol-gguf", "smol-int8"])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--label", default="after")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--dispatch-requests", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=50.0)
    args = parser.parse_args()
    started = provenance()
    path = results_path("models", started)
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.part == "mix":
        record = {"provenance": started, **mix(args.url, args.models, args.requests)}
        update_results("models", started, {"mix": {**results.get("mix", {}), args.label: record}})
        print(f"{args.label}: {record['wrong_model_answers']} of {args.requests} answers from another model's "
              f"worker ({record['failed']} failed)")
    else:
        record = {"provenance": started, **dispatch(args.rounds, args.streams, args.dispatch_requests,
                                                    args.tokens, args.step_ms)}
        update_results("models", started, {"dispatch": record})
        print(json.dumps(record["medians"], indent=1), json.dumps(record["two_over_one"], indent=1))


if __name__ == "__main__":
    main()
