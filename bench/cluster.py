"""Issue 14, part 3: what a Redis Cluster costs against the single server, in one run, loopback only.

stack: two ENGINE=sim stacks side by side, one on a redis-server and one on a cluster of three masters
    (redis-server --cluster-enabled yes), taking turns for several rounds of the same load; output tokens/s
    and inter-token latency of each, median round.
publish: one worker step's results published as the worker does (common/resultlog.py) for 16 / 64 / 256
    rows: one script call on one server, one per request's slot in a cluster (one pipeline); median ms.
admit: one streamed request admitted as the gateway does (gateway/admission.py); a cluster first creates the
    request's log in its own slot, then runs the admission script; median ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.clients import sync_client  # noqa: E402
from common.keys import Keys  # noqa: E402
from common.protocol import SamplingParams, StreamMeta, Submit, Token, encode, now  # noqa: E402
from common.resultlog import publish_results  # noqa: E402
from common.settings import Settings  # noqa: E402
from gateway.bus import Bus  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from harness.topology import start_cluster  # noqa: E402
from llmserve.launcher import start_redis  # noqa: E402
from llmserve.loadgen.client import Sampling, Target  # noqa: E402
from llmserve.loadgen.run import Level, run_level  # noqa: E402
from llmserve.loadgen.workload import Lengths, make_jobs  # noqa: E402
from llmserve.processes import free_port  # noqa: E402

KINDS = ("single", "cluster")


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def sim_settings(args: argparse.Namespace) -> dict[str, str]:
    return {"ENGINE": "sim", "SIM_STEP_MS": str(args.step_ms), "SIM_STEP_PER_SEQ_MS": "0",
            "WORKER_SLOTS": str(args.slots), "LOG_LEVEL": "WARNING"}


def load(url: str, args: argparse.Namespace, round_index: int) -> dict:
    jobs = make_jobs(args.requests, Lengths("fixed", 8), Lengths("fixed", args.tokens), seed=round_index)
    return asyncio.run(run_level(Target(url, "native"), jobs, Sampling(), Level(args.streams, None), seed=round_index,
                                 show_progress=False))


def stack(args: argparse.Namespace) -> dict:
    """Both stacks up at once; each round runs the load on one, then the other (the order alternating)."""
    rounds: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    with private_stack(args.workers, **sim_settings(args)) as single, \
            private_stack(args.workers, redis="cluster", **sim_settings(args)) as cluster:
        urls = {"single": single.url, "cluster": cluster.url}
        for kind in KINDS:
            load(urls[kind], args, 0)  # warm-up
        for i in range(args.rounds):
            for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
                result = load(urls[kind], args, i + 1)
                rounds[kind].append({"output_tok_s": result["output_tok_s"], "failed": result["failed"],
                                     "itl_p50_ms": result["itl_s"]["p50"] * 1000,
                                     "itl_p99_ms": result["itl_s"]["p99"] * 1000})
                print(kind, json.dumps(rounds[kind][-1]), flush=True)
    summary = {kind: {"output_tok_s": statistics.median(r["output_tok_s"] for r in rows),
                      "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in rows),
                      "itl_p99_ms": statistics.median(r["itl_p99_ms"] for r in rows),
                      "failed": sum(r["failed"] for r in rows)} for kind, rows in rounds.items()}
    summary["cluster_over_single"] = summary["cluster"]["output_tok_s"] / summary["single"]["output_tok_s"]
    return {"workers": args.workers, "slots": args.slots, "step_ms": args.step_ms, "streams": args.streams,
            "requests": args.requests, "tokens": args.tokens, "rounds": rounds, "median": summary}


def timed(action: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


def publish_step(url: str, rows: int) -> Callable[[], object]:
    """One worker step's publish of `rows` tokens, as worker/main.py sends it."""
    keys, settings, client = Keys("bench"), Settings(redis_url=url, namespace="bench"), sync_client(url)
    results = [(f"pub-{rows}-{i}", encode(Token(7, " word"), 1 << 20), 42) for i in range(rows)]

    def step() -> object:
        pipe = client.pipeline(transaction=False)
        publish_results(pipe, keys, settings, results)
        return pipe.execute()

    return step


def publish(urls: dict[str, str], rows_list: list[int], repeats: int) -> dict:
    out: dict[str, dict[int, float]] = {}
    for kind, url in urls.items():
        out[kind] = {}
        for rows in rows_list:
            step = publish_step(url, rows)
            timed(step, 5)  # warm-up: scripts cached, connections open
            out[kind][rows] = median_ms(timed(step, repeats))
        print("publish", kind, json.dumps(out[kind]), flush=True)
    return out


def admit(urls: dict[str, str], repeats: int) -> dict:
    out = {}
    for kind, url in urls.items():
        settings = Settings(redis_url=url, namespace=f"admit-{kind}", max_queue=1 << 30, max_queue_bytes=1 << 40,
                            trace_ttl=0)

        async def measure(settings: Settings = settings) -> list[float]:
            bus = Bus(settings)
            samples = []
            for i in range(repeats + 5):
                submit = Submit(f"admit-{i}", SamplingParams(), prompt="hello there", submitted_at=now(), tenant="t")
                meta = StreamMeta("seed", [submit.request_id])
                started = time.perf_counter()
                await bus.admission.admit([submit], meta)
                samples.append(time.perf_counter() - started)
            await bus.redis.aclose()
            return samples[5:]

        out[kind] = median_ms(asyncio.run(measure()))
        print("admit", kind, out[kind], "ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    started = provenance()
    result: dict[str, object] = {"stack": stack(args)}
    single_url = f"redis://127.0.0.1:{free_port()}/0"
    server, cluster = start_redis(single_url), start_cluster()
    try:
        urls = {"single": single_url, "cluster": cluster.url}
        result["publish_ms"] = publish(urls, args.rows, args.repeats)
        result["admit_ms"] = admit(urls, args.repeats)
    finally:
        server.terminate()
        server.wait()
        cluster.stop()
    write_results("cluster", started, result)
    print(json.dumps({"stack": result["stack"]["median"], "publish_ms": result["publish_ms"],
                      "admit_ms": result["admit_ms"]}, indent=2))


if __name__ == "__main__":
    main()
