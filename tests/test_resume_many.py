"""Several clients resuming one stream at once on one gateway (real redis-server, gateway, scheduler and an
ENGINE=sim worker as processes, real HTTP and SSE): a duplicated browser tab, a retry while the first resume
is still open, a proxy holding a half-open connection. Each reader gets the whole stream from its position
and ends with the request; none waits for ever. A Last-Event-ID past what the stream has reached is a 400."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from harness.stacks import PrivateStack, private_stack
from llmserve.processes import free_port
from tests.sse import Event, events

TOKENS = 200
SETTINGS = {"ENGINE": "sim", "SIM_STEP_MS": "10", "SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": "8",
            "RESUME_GRACE": "5", "RESUME_TTL": "60", "NAMESPACE": "many", "HEARTBEAT_INTERVAL": "0.2",
            "WORKER_TTL": "2", "LOG_LEVEL": "WARNING"}
# A reader that hangs is cut here, and fails.
READ_SECONDS = 30.0


@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    settings = {**SETTINGS, "SCHEDULER_METRICS_PORT": str(free_port()), "WORKER_METRICS_PORT": str(free_port())}
    with private_stack(1, **settings) as running:
        yield running


@dataclass
class Read:
    status: int
    events: list[Event]
    ended_at: float
    error: str = ""


def started_and_dropped(url: str, prompt: str, tokens: int = TOKENS) -> str:
    """A seed stream whose client leaves after its first event; its request_id."""
    with httpx.Client(timeout=READ_SECONDS) as client, client.stream(
            "POST", f"{url}/generate_stream", json={"prompt": prompt, "max_tokens": tokens}) as response:
        assert response.status_code == 200
        next(events(response))
        return response.headers["x-request-id"]


def resumed(url: str, request_id: str, last_id: str | None = None) -> Read:
    headers = {"Last-Event-ID": last_id} if last_id is not None else {}
    try:
        with httpx.Client(timeout=READ_SECONDS) as client, client.stream(
                "GET", f"{url}/v1/requests/{request_id}/stream", headers=headers) as response:
            got = list(events(response)) if response.status_code == 200 else []
            if response.status_code != 200:
                response.read()
            return Read(response.status_code, got, time.monotonic())
    except httpx.HTTPError as exc:
        return Read(0, [], time.monotonic(), f"{type(exc).__name__}: {exc}")


def resumed_at_once(url: str, request_id: str, readers: int) -> list[Read]:
    with ThreadPoolExecutor(readers) as pool:
        return list(pool.map(lambda _: resumed(url, request_id), range(readers)))


def whole(read: Read) -> list[tuple[str | None, str]]:
    """What a reader got: each event's id and text (the end's reason for the last)."""
    return [(e.id, e.data.get("token", e.data.get("finish_reason", ""))) for e in read.events]


def check_whole_and_together(reads: list[Read]) -> None:
    hung = [r.error for r in reads if r.error]
    assert not hung, f"{len(hung)} of {len(reads)} readers failed: {hung[:3]}"
    assert all(r.status == 200 for r in reads), [r.status for r in reads]
    first = whole(reads[0])
    assert [event_id for event_id, _ in first] == [str(i) for i in range(TOKENS + 1)]
    assert first[-1][1] == "length"
    assert all(whole(r) == first for r in reads)
    # All of them end with the request, not one after another or at a timeout.
    ends = [r.ended_at for r in reads]
    assert max(ends) - min(ends) < 5.0


@pytest.mark.parametrize("readers", [1, 3, 50])
def test_readers_who_resume_at_once_while_it_runs_each_get_the_whole_stream(sim: PrivateStack, readers: int) -> None:
    request_id = started_and_dropped(sim.url, f"resumed {readers} times at once")
    check_whole_and_together(resumed_at_once(sim.url, request_id, readers))


def test_readers_who_resume_at_once_after_its_end_each_get_the_whole_stream(sim: PrivateStack) -> None:
    request_id = started_and_dropped(sim.url, "resumed after its end")
    check_whole_and_together([resumed(sim.url, request_id)])  # returns once the request has ended
    check_whole_and_together(resumed_at_once(sim.url, request_id, 50))


def test_a_reader_who_leaves_does_not_end_the_stream_for_the_others(sim: PrivateStack) -> None:
    request_id = started_and_dropped(sim.url, "one of them leaves")
    with ThreadPoolExecutor(4) as pool:
        staying = [pool.submit(resumed, sim.url, request_id) for _ in range(3)]
        with httpx.Client(timeout=READ_SECONDS) as client, client.stream(
                "GET", f"{sim.url}/v1/requests/{request_id}/stream") as leaving:
            next(events(leaving))
        check_whole_and_together([future.result() for future in staying])


def test_a_position_the_stream_has_not_reached_is_a_400(sim: PrivateStack) -> None:
    request_id = started_and_dropped(sim.url, "positions", tokens=3000)
    ahead = resumed(sim.url, request_id, "2999")  # 30 s of tokens away
    assert ahead.status == 400
    assert httpx.delete(f"{sim.url}/v1/requests/{request_id}").status_code == 204
    request_id = started_and_dropped(sim.url, "ended positions", tokens=5)
    assert resumed(sim.url, request_id).status == 200  # returns once the request has ended
    assert resumed(sim.url, request_id, "5").status == 204  # its end: nothing left
    with httpx.Client(base_url=sim.url) as client:
        for past in ("6", "1000000000000000000000000000000"):
            answer = client.get(f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": past})
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["code"] == "invalid_value" and error["param"] == "Last-Event-ID"
            assert "has not reached" in error["message"]
