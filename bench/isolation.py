"""Isolation figures (issue 10), each side by side in one run:

- fairness: time to first token of a light API key (one request at a time) while a heavy key floods
  the cluster, under SCHEDULING_POLICY=fair and fifo, and with no flood at all;
- memory: Redis bytes left behind per finished request with large prompts, once traces have expired
  (TRACE_TTL=1) and with the default TRACE_TTL;
- slow-readers: gateway memory while N clients open a long stream and never read (small receive
  buffers), until CLIENT_BUFFER_BYTES cancels them, and whether a normal request is served meanwhile.

The control plane is what is measured, so the workers are ENGINE=sim; the policy code is the same
for the real model."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import time
from pathlib import Path

import httpx
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.memory import memory_mb  # noqa: E402
from bench.provenance import provenance, update_results  # noqa: E402
from harness.sse import aparse  # noqa: E402
from harness.stacks import private_stack  # noqa: E402
from llmserve.loadgen.stats import describe  # noqa: E402

SIM = {"ENGINE": "sim", "SIM_STEP_MS": "20", "SIM_STEP_PER_SEQ_MS": "0.5", "LOG_LEVEL": "WARNING",
       "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2"}


async def first_token_s(client: httpx.AsyncClient, key: str, max_tokens: int) -> float:
    body = {"prompt": "light question", "max_tokens": max_tokens}
    sent = time.monotonic()
    async with client.stream("POST", "/generate_stream", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        ttft = None
        async for _ in aparse(response.aiter_lines()):
            if ttft is None:
                ttft = time.monotonic() - sent
    if ttft is None:
        raise RuntimeError("no token")
    return ttft


async def flood(client: httpx.AsyncClient, stop: asyncio.Event, max_tokens: int) -> int:
    done = 0
    while not stop.is_set():
        response = await client.post("/generate", json={"prompt": "heavy work", "max_tokens": max_tokens},
                                     headers={"Authorization": "Bearer heavy"})
        done += response.status_code == 200
    return done


async def fairness_round(url: str, flooders: int, light_requests: int) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        stop = asyncio.Event()
        started = time.monotonic()
        heavy = [asyncio.create_task(flood(client, stop, 128)) for _ in range(flooders)]
        await asyncio.sleep(3 if flooders else 0)
        ttfts = []
        for _ in range(light_requests):
            ttfts.append(await first_token_s(client, "light", 8))
            await asyncio.sleep(0.2)
        stop.set()
        heavy_done = sum(await asyncio.gather(*heavy))
        seconds = time.monotonic() - started
    return {"light_ttft_s": describe(ttfts), "heavy_completed": heavy_done, "seconds": seconds,
            "heavy_tok_s": heavy_done * 128 / seconds}


def fairness(args: argparse.Namespace) -> dict[str, object]:
    results = {}
    for label, policy, flooders in (("no flood", "fair", 0), ("fair", "fair", args.flooders),
                                    ("fifo", "fifo", args.flooders)):
        settings = {**SIM, "API_KEYS": "heavy,light", "SCHEDULING_POLICY": policy, "WORKER_SLOTS": "16",
                    "KEY_MAX_REQUESTS": "0"}
        with private_stack(1, **settings) as running:
            results[label] = asyncio.run(fairness_round(running.url, flooders, args.light_requests))
        print(label, json.dumps(results[label]), flush=True)
    base = results["no flood"]["light_ttft_s"]["p50"]
    for label in ("fair", "fifo"):
        results[label]["p50_over_no_flood"] = results[label]["light_ttft_s"]["p50"] / base
    return {"flooders": args.flooders, "light_requests": args.light_requests, "worker_slots": 16, **results}


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def memory_round(trace_ttl: str, requests: int, prompt_bytes: int) -> dict[str, object]:
    with private_stack(1, **SIM, TRACE_TTL=trace_ttl) as running:
        r = redis.Redis.from_url(running.redis_url)
        with httpx.Client(base_url=running.url, timeout=120) as client:
            client.post("/generate", json={"prompt": "warm up", "max_tokens": 2}).raise_for_status()
            time.sleep(1)
            baseline = used_memory(r)
            for _ in range(requests):
                body = {"prompt": "x" * prompt_bytes, "max_tokens": 16}  # one sim token, many bytes
                client.post("/generate", json=body).raise_for_status()
            time.sleep(float(trace_ttl) + 1.5 if float(trace_ttl) < 10 else 1.5)
            after = used_memory(r)
        keys = sorted({k.decode().split(":")[1] for k in r.scan_iter("*")})
    return {"trace_ttl": trace_ttl, "requests": requests, "prompt_bytes": prompt_bytes, "baseline_bytes": baseline,
            "after_bytes": after, "left_per_request_bytes": (after - baseline) / requests, "key_kinds_left": keys}


def memory(args: argparse.Namespace) -> dict[str, object]:
    rounds = [memory_round(ttl, args.requests, args.prompt_bytes) for ttl in ("1", "600")]
    for result in rounds:
        print(json.dumps(result), flush=True)
    return {"rounds": rounds}


def slow_readers(args: argparse.Namespace) -> dict[str, object]:
    settings = {**SIM, "SIM_STEP_MS": "50", "SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": str(args.readers + 16),
                "CLIENT_BUFFER_BYTES": str(args.buffer_bytes)}
    with private_stack(1, **settings) as running:
        gateway = psutil.Process(next(p.pid for name, p in running.stack.processes if name == "gateway"))
        httpx.post(f"{running.url}/generate", json={"prompt": "warm", "max_tokens": 2}, timeout=30)
        idle = gateway.memory_info().rss
        body = json.dumps({"prompt": "go on", "max_tokens": 8000}).encode()
        head = (f"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        clients = []
        for _ in range(args.readers):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", int(running.url.rsplit(":", 1)[1])))
            sock.sendall(head + body)
            clients.append(sock)
        samples = []
        started = time.monotonic()
        while time.monotonic() - started < args.seconds:
            time.sleep(5)
            health = httpx.get(f"{running.url}/health", timeout=60).json()
            cancelled = re.search(r"^llmserve_gateway_slow_clients_total (\S+)$",
                                  httpx.get(f"{running.url}/metrics").text, re.M)
            samples.append({"s": round(time.monotonic() - started), "rss_mb": gateway.memory_info().rss / 2**20,
                            "running": health["running"], "cancelled": float(cancelled.group(1)) if cancelled else 0})
            print(json.dumps(samples[-1]), flush=True)
        sent = time.monotonic()
        normal = httpx.post(f"{running.url}/generate", json={"prompt": "still there?", "max_tokens": 2}, timeout=30)
        normal_s = time.monotonic() - sent
        peak = memory_mb(gateway.pid)["peak"]
        for sock in clients:
            sock.close()
        exited = running.stack.exited()
    return {"readers": args.readers, "client_buffer_bytes": args.buffer_bytes, "idle_rss_mb": idle / 2**20,
            "peak_rss_mb": peak, "samples": samples, "normal_request": [normal.status_code, normal_s],
            "services_exited": exited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["fairness", "memory", "slow-readers", "all"], nargs="?", default="all")
    parser.add_argument("--flooders", type=int, default=48, help="concurrent heavy-key requests")
    parser.add_argument("--light-requests", type=int, default=20)
    parser.add_argument("--requests", type=int, default=30, help="large requests for the memory part")
    parser.add_argument("--prompt-bytes", type=int, default=900_000)
    parser.add_argument("--readers", type=int, default=1000, help="clients that never read")
    parser.add_argument("--buffer-bytes", type=int, default=64 << 10, help="CLIENT_BUFFER_BYTES")
    parser.add_argument("--seconds", type=float, default=90)
    args = parser.parse_args()
    started = provenance()
    out = {}
    if args.part in ("fairness", "all"):
        out["fairness"] = fairness(args)
    if args.part in ("memory", "all"):
        out["memory"] = memory(args)
    if args.part in ("slow-readers", "all"):
        out["slow_readers"] = slow_readers(args)
    update_results("isolation", started, out)


if __name__ == "__main__":
    main()
