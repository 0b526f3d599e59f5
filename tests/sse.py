"""The tests' one SSE client: events as (event, id, data) as a client sees them (harness/sse.py's parser), and a
stream read whole (or up to a number of events) with what the tests ask of it: its request id, token indexes, text,
how it ended, and when each event arrived."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from harness.sse import DONE as DONE  # the names the tests take from here
from harness.sse import Event as Event
from harness.sse import parse as parse


def events(response: httpx.Response) -> Iterator[Event]:
    return parse(response.iter_lines())


def stream(client: httpx.Client, body: dict) -> tuple[str, list[Event]]:
    with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.headers["x-request-id"], list(events(response))


@dataclass
class Streamed:
    """What one connection got: its status and headers, the events it read so far (the body instead, when the
    answer was not a stream), and the time.monotonic() of the request and of each event's arrival."""

    status: int = 0
    headers: httpx.Headers = field(default_factory=httpx.Headers)
    started: float = 0.0
    events: list[Event] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    body: bytes = b""

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def tokens(self) -> list[dict]:
        """The native stream's token events' data."""
        return [e.data for e in self.events if e.event is None and "index" in e.data]

    @property
    def indexes(self) -> list[int]:
        return [t["index"] for t in self.tokens]

    @property
    def text(self) -> str:
        return "".join(t["token"] for t in self.tokens)

    @property
    def final(self) -> dict:
        """The last event's data when it is not a token: the final event, or an error's."""
        last = self.events[-1] if self.events else None
        return last.data if last is not None and "index" not in last.data else {}

    @property
    def ended(self) -> str:
        """'done', 'error' (an error event last), 'open' (read up to a count) or 'status <code>'."""
        if self.status != 200:
            return f"status {self.status}"
        if not self.events or "index" in self.events[-1].data:
            return "open"
        return "error" if self.events[-1].event == "error" else "done"

    @property
    def first_token_s(self) -> float:
        """Seconds from the request to its first token."""
        first = next(i for i, e in enumerate(self.events) if "index" in e.data)
        return self.arrived[first] - self.started


def read(url: str, path: str, method: str | None = None, body: dict | None = None, headers: dict | None = None,
         upto: int | None = None, *, on_token: Callable[[str, int], object] | None = None, timeout: float = 120.0,
         into: Streamed | None = None) -> Streamed:
    """Open a stream (POST with a body, else GET) and read it to its end; with `upto`, drop the connection after
    that many events. After each token of a native stream, `on_token(request_id, index)`. `into` shows the events
    as they arrive (to another thread)."""
    got = into if into is not None else Streamed()
    got.started = time.monotonic()
    method = method or ("POST" if body is not None else "GET")
    with httpx.Client(timeout=timeout) as client, client.stream(method, f"{url}{path}", json=body,
                                                                headers=headers) as response:
        got.status, got.headers = response.status_code, response.headers
        if response.status_code != 200 or not response.headers["content-type"].startswith("text/event-stream"):
            got.body = response.read()
            return got
        for event in events(response):
            got.events.append(event)
            got.arrived.append(time.monotonic())
            if on_token is not None and event.event is None and "index" in event.data:
                on_token(got.request_id, event.data["index"])
            if upto is not None and len(got.events) >= upto:
                break
    return got


@dataclass
class Reading:
    """Streams read on threads of their own, each Streamed filling as its events arrive."""

    streams: list[Streamed]
    threads: list[threading.Thread]
    errors: list[str]

    def join(self, timeout: float) -> None:
        """Wait for every stream to end; one still open after `timeout`, or a reader that raised, fails the test."""
        for thread in self.threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self.threads), "a stream hung"
        assert not self.errors, self.errors


def read_in_background(url: str, bodies: list[dict], timeout: float = 120.0) -> Reading:
    """POST each body to /generate_stream and read it on a thread of its own."""
    reading = Reading([Streamed() for _ in bodies], [], [])

    def run(body: dict, into: Streamed) -> None:
        try:
            read(url, "/generate_stream", body=body, timeout=timeout, into=into)
        except Exception as exc:  # reported by join(), not lost with the thread
            reading.errors.append(f"{type(exc).__name__}: {exc}")

    reading.threads = [threading.Thread(target=run, args=(body, into), daemon=True)
                       for body, into in zip(bodies, reading.streams, strict=True)]
    for thread in reading.threads:
        thread.start()
    return reading
