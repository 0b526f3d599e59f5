"""Streams that outlive their connection (issue 11): a stack with two gateways on one Redis, and
clients that lose their stream and resume it on the other gateway with Last-Event-ID.

drop: each client drops its connection after a few tokens, several times a stream, and resumes
    at once on the other gateway;
kill: kill -9 of the gateway holding the streams; each client resumes on the other gateway as
    soon as its connection ends (the killed gateway is restarted for the next round).

For every break: the gap the client sees between the last token before the break and the first
after the resume, and the time from the break to the resumed response's headers (a new connection,
the request, the logs read); for every stream: tokens lost and tokens received twice (both must be 0) and
whether its text equals the unbroken text. ENGINE=sim by default (texts known in advance);
--engine hf uses the real model, greedy, against an unbroken run. Writes
bench/results/resume_<engine>-<host kind>.json."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.protocol import SamplingParams, Submit  # noqa: E402
from harness.sse import parse  # noqa: E402
from harness.stacks import PrivateStack, private_stack  # noqa: E402
from llmserve.processes import free_port, wait_until  # noqa: E402
from worker.sim import VOCAB, SimModel, sim_token  # noqa: E402


@dataclass
class Stream:
    """One client's stream across its connections."""

    prompt: str
    tokens: int
    indexes: list[int] = field(default_factory=list)
    text: str = ""
    gaps: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    connections: int = 0
    ended: bool = False
    request_id: str = ""
    last_id: str | None = None
    last_at: float | None = None
    broken_at: float | None = None  # the time of the last token before a break, until the next token comes
    reconnects: list[float] = field(default_factory=list)  # from a break to the resumed response's headers
    break_noticed: float | None = None
    last_event: dict = field(default_factory=dict)

    def body(self, greedy: bool) -> dict[str, object]:
        sampling = {"temperature": 0, "ignore_eos": True} if greedy else {}
        return {"prompt": self.prompt, "max_tokens": self.tokens, **sampling}

    def read(self, client: httpx.Client, url: str, body: dict | None, stop_after: int | None) -> None:
        """One connection: POST the request (`body`), or resume it; read until the end, a break, or
        `stop_after` tokens (then drop the connection)."""
        self.connections += 1
        if body is not None:
            request = client.build_request("POST", f"{url}/generate_stream", json=body)
        else:
            request = client.build_request("GET", f"{url}/v1/requests/{self.request_id}/stream",
                                           headers={"Last-Event-ID": self.last_id or ""})
        taken = 0
        try:
            response = client.send(request, stream=True)
        except httpx.HTTPError:
            return
        if self.break_noticed is not None:
            self.reconnects.append(time.monotonic() - self.break_noticed)
            self.break_noticed = None
        try:
            if response.status_code == 204:
                self.ended = True
                return
            response.raise_for_status()
            self.request_id = response.headers["x-request-id"]
            for event in parse(response.iter_lines()):
                self._event(event.id, event.data)
                if "index" in self.last_event:
                    taken += 1
                if self.ended or (stop_after is not None and taken >= stop_after):
                    break
        except httpx.HTTPError:
            pass  # the connection broke: resume
        finally:
            response.close()
        if self.last_at is not None and not self.ended:
            self.broken_at = self.last_at
            self.break_noticed = time.monotonic()

    def _event(self, event_id: str | None, data: dict) -> None:
        self.last_event = data
        self.last_id = event_id
        if "index" in data:
            now = time.monotonic()
            if self.broken_at is not None:
                self.gaps.append(now - self.broken_at)
                self.broken_at = None
            elif self.last_at is not None:
                self.itls.append(now - self.last_at)
            self.last_at = now
            self.indexes.append(data["index"])
            self.text += data["token"]
        else:
            self.ended = True

    def check(self, expected: str) -> dict[str, int | bool]:
        seen = set(self.indexes)
        return {"lost": len(set(range(self.tokens)) - seen), "duplicated": len(self.indexes) - len(seen),
                "text_equal": self.text == expected and self.ended}


def sim_text(prompt: str, tokens: int) -> str:
    length = len(SimModel().prompt_ids(Submit("x", SamplingParams(), prompt=prompt)))
    return "".join(VOCAB[sim_token(length + i)] for i in range(tokens))


def drop(stack: PrivateStack, streams: list[Stream], breaks: int, greedy: bool, rng: random.Random) -> None:
    """Each stream drops its connection `breaks` times after a few tokens, resuming on the other gateway."""

    span = max(4, streams[0].tokens // (breaks + 1))  # every break falls inside the stream

    def client_of(stream: Stream) -> None:
        with httpx.Client(timeout=120) as client:
            stream.read(client, stack.urls[0], stream.body(greedy), rng.randint(3, span))
            for attempt in range(1, 10 * breaks):
                url = stack.urls[attempt % 2]
                stream.read(client, url, None, rng.randint(3, span) if attempt < breaks else None)
                if stream.ended:
                    return

    threads = [threading.Thread(target=client_of, args=(s,)) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def kill(stack: PrivateStack, streams: list[Stream], greedy: bool, after: int) -> None:
    """Every stream starts on one gateway, which is killed (-9) once each has `after` tokens; each resumes
    on the other gateway as soon as its connection ends. The killed gateway is started again."""
    victim = round_robin = stack.urls[0]

    def client_of(stream: Stream) -> None:
        with httpx.Client(timeout=120) as client:
            stream.read(client, round_robin, stream.body(greedy), None)
            other = stack.urls[1] if round_robin == stack.urls[0] else stack.urls[0]
            while not stream.ended and stream.connections < 20:
                stream.read(client, other, None, None)

    threads = [threading.Thread(target=client_of, args=(s,)) for s in streams]
    for thread in threads:
        thread.start()
    wait_until(lambda: all(len(s.indexes) >= after for s in streams), 120, "every stream's first tokens", 0.005)
    index, process = gateway_process(stack, victim)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    for thread in threads:
        thread.join()
    # The killed gateway comes back on its port for the next round.
    port = victim.rsplit(":", 1)[1]
    stack.stack.processes[index] = ("gateway", stack.stack.launch("gateway", {"GATEWAY_PORT": port}))
    wait_until(lambda: responds(victim), 30, "the restarted gateway")


def gateway_process(stack: PrivateStack, url: str) -> tuple[int, object]:
    port = url.rsplit(":", 1)[1]
    for index, (name, process) in enumerate(stack.stack.processes):
        if name == "gateway" and stack.stack.overrides.get(index, {}).get("GATEWAY_PORT") == port:
            return index, process
    raise LookupError(url)


def responds(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def summary(streams: list[Stream], expected: dict[str, str]) -> dict[str, object]:
    gaps = sorted(g for s in streams for g in s.gaps)
    itls = sorted(i for s in streams for i in s.itls)
    reconnects = sorted(r for s in streams for r in s.reconnects)
    checks = [s.check(expected[s.prompt]) for s in streams]
    return {
        "streams": len(streams), "breaks": len(gaps), "connections": sum(s.connections for s in streams),
        "tokens_lost": sum(c["lost"] for c in checks), "tokens_duplicated": sum(c["duplicated"] for c in checks),
        "texts_equal_to_unbroken": sum(c["text_equal"] for c in checks),
        "gap_s_median": statistics.median(gaps) if gaps else None,
        "gap_s_p99": gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))] if gaps else None,
        "gap_s_max": gaps[-1] if gaps else None,
        "inter_token_s_median_unbroken": statistics.median(itls) if itls else None,
        "reconnect_s_median": statistics.median(reconnects) if reconnects else None,
        "reconnect_s_p99": reconnects[min(len(reconnects) - 1, round(0.99 * (len(reconnects) - 1)))]
        if reconnects else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("sim", "hf"), default="sim")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams per scenario round")
    parser.add_argument("--breaks", type=int, default=5, help="drops per stream (drop scenario)")
    parser.add_argument("--kills", type=int, default=5, help="rounds of kill -9 (kill scenario)")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0, help="with --engine sim: the step time")
    parser.add_argument("--out", type=Path, help="default: bench/results/resume_<engine>-<host kind>.json")
    args = parser.parse_args()
    started = provenance()
    greedy = args.engine == "hf"
    tokens = min(args.tokens, 96) if greedy else args.tokens
    settings = {"ENGINE": args.engine, "SIM_STEP_MS": str(args.step_ms), "SIM_STEP_PER_SEQ_MS": "0",
                "NAMESPACE": "resumebench", "HEARTBEAT_INTERVAL": "0.3", "WORKER_TTL": "2", "LOG_LEVEL": "WARNING",
                "WORKER_THREADS": "1", "SCHEDULER_METRICS_PORT": str(free_port()),
                "WORKER_METRICS_PORT": str(free_port())}
    rng = random.Random(11)
    prompts = [f"Write a long essay about {topic}." for topic in ("ships", "bread", "rivers", "clocks", "bees",
                                                                    "glass", "trains", "paper")][:args.streams]
    report: dict[str, object] = {"engine": args.engine, "tokens_per_stream": tokens,
                                 "sim_step_ms": args.step_ms if not greedy else None}
    with private_stack(1 if not greedy else 2, gateways=2, **settings) as stack:
        if greedy:
            expected = {}
            for prompt in prompts:
                unbroken = Stream(prompt, tokens)
                with httpx.Client(timeout=300) as client:
                    unbroken.read(client, stack.url, unbroken.body(True), None)
                expected[prompt] = unbroken.text
        else:
            expected = {p: sim_text(p, tokens) for p in prompts}
        streams = [Stream(p, tokens) for p in prompts]
        drop(stack, streams, args.breaks, greedy, rng)
        report["drop"] = summary(streams, expected)
        print("drop:", json.dumps(report["drop"]), flush=True)
        killed: list[Stream] = []
        for _ in range(args.kills):
            streams = [Stream(p, tokens) for p in prompts]
            kill(stack, streams, greedy, after=rng.randint(3, tokens // 3))
            killed += streams
        report["kill"] = summary(killed, expected)
        print("kill:", json.dumps(report["kill"]), flush=True)
    print(f"wrote {write_results(f'resume_{args.engine}', started, report, args.out)}")


if __name__ == "__main__":
    main()
