"""One streamed request, timed token by token.

A small HTTP/1.1 client on asyncio streams: at a thousand concurrent streams a
general-purpose client costs more CPU than the server it measures, and the
load generator shares this machine's cores with it.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

from llmserve.loadgen.workload import Job


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True


@dataclass(frozen=True)
class Target:
    """Where requests go and in which dialect: `native` is llmserve's `/generate_stream`,
    `openai` is `/v1/completions` with `stream: true` on any compatible server, `chat` its
    `/v1/chat/completions` (a job's shared text as the system message, its prompt as the user's)."""

    url: str
    api: str = "openai"
    model: str = ""
    api_key: str = ""

    def request(self, job: Job, sampling: Sampling) -> tuple[str, bytes]:
        body: dict[str, object] = {"max_tokens": job.max_tokens, "temperature": sampling.temperature,
                                   "top_p": sampling.top_p}
        if self.api == "chat":
            system = [{"role": "system", "content": job.shared}] if job.shared else []
            body["messages"] = [*system, {"role": "user", "content": job.prompt}]
        else:
            body["prompt"] = f"{job.shared}\n\n{job.prompt}" if job.shared else job.prompt
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.ignore_eos:
            # Extensions: vLLM and llama-server take ignore_eos, llama-cpp-python's server only min_tokens.
            body |= {"ignore_eos": True, "min_tokens": job.max_tokens}
        if self.api == "native":
            return "/generate_stream", msgspec.json.encode(body)
        body |= {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions", msgspec.json.encode(body)


@dataclass
class Outcome:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    ended: float = 0.0
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)


class _Reader:
    """Turns a streamed body into SSE `data:` payloads, and records when tokens arrive."""

    def __init__(self, api: str, outcome: Outcome) -> None:
        self.api = api
        self.outcome = outcome
        self.pending = b""

    def feed(self, chunk: bytes) -> None:
        now = time.perf_counter()
        self.pending = (self.pending + chunk).replace(b"\r\n", b"\n")  # a CRLF may straddle two chunks
        *events, self.pending = self.pending.split(b"\n\n")
        for event in events:
            data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                self._payload(msgspec.json.decode(data), event.startswith(b"event: error"), now)

    def _payload(self, payload: dict, is_error: bool, now: float) -> None:
        if is_error or "error" in payload:
            self.outcome.error = str(payload.get("error"))
        elif self.api == "native":
            if "index" in payload:
                self.outcome.token_times.append(now)
            elif "completion_tokens" in payload:
                self.outcome.completion_tokens = payload["completion_tokens"]
        else:
            if payload.get("usage"):
                self.outcome.completion_tokens = payload["usage"].get("completion_tokens")
            choices = payload.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                self.outcome.token_times.append(now)


async def _body(reader: asyncio.StreamReader, headers: dict[str, str], feed: Callable[[bytes], object]) -> None:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0], 16):
            feed((await reader.readexactly(size + 2))[:-2])
        return
    if "content-length" in headers:
        feed(await reader.readexactly(int(headers["content-length"])))
        return
    while chunk := await reader.read(65536):
        feed(chunk)


async def stream(target: Target, job: Job, sampling: Sampling) -> Outcome:
    """Send one request and read its stream to the end; failures are recorded, never raised."""
    parts = urlsplit(target.url)
    secure = parts.scheme == "https"
    path, payload = target.request(job, sampling)
    head = (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n"
            f"Content-Length: {len(payload)}\r\n")
    if target.api_key:
        head += f"Authorization: Bearer {target.api_key}\r\n"
    outcome = Outcome(sent=time.perf_counter())
    writer = None
    try:
        reader, writer = await asyncio.open_connection(
            parts.hostname, parts.port or (443 if secure else 80),
            ssl=ssl.create_default_context() if secure else None, limit=1 << 20)
        writer.write(head.encode() + b"\r\n" + payload)
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            body = bytearray()
            await _body(reader, headers, body.extend)
            outcome.error = f"HTTP {status}: {bytes(body[:300]).decode(errors='replace')}"
        else:
            await _body(reader, headers, _Reader(target.api, outcome).feed)
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, msgspec.DecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended = time.perf_counter()
        if writer is not None:
            writer.close()
    return outcome
