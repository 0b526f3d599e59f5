"""The gateway's bounds on what one client can hold, on a running stack (ENGINE=sim workers,
real redis-server, real HTTP and raw sockets): a client that stops reading is cancelled past
CLIENT_BUFFER_BYTES, heads and bodies that never end are cut off, each API key has its share
of the queue and the queue is bounded in bytes, and a Redis that refuses writes is a 503."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import httpx
import pytest
import redis

from common.keys import PAYLOAD, Keys
from harness.stacks import PrivateStack
from llmserve.launcher import Stack
from llmserve.processes import free_port
from tests.conftest import redis_server, responds, sim_stack, wait_for

ALPHA = {"Authorization": "Bearer alpha"}
BETA = {"Authorization": "Bearer beta"}
KEY_MAX_REQUESTS = 4
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
MAX_HEADER_BYTES = 8192
LONG = {"model": "sim", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 8000,
        "n": KEY_MAX_REQUESTS, "stream": True}
SHORT = {"prompt": "hello", "max_tokens": 2}
# A stream whose client leaves runs on this long, in case it comes back (tests/test_resume.py).
RESUME_GRACE = 1.0


@pytest.fixture(scope="module")
def limits() -> Iterator[PrivateStack]:
    # Steps of 20 ms: a long request streams for minutes, and a slow client overflows within seconds.
    settings = {"SIM_STEP_PER_SEQ_MS": "0", "WORKER_SLOTS": "16",
                "API_KEYS": "alpha,beta", "KEY_MAX_REQUESTS": str(KEY_MAX_REQUESTS), "CLIENT_BUFFER_BYTES": "16384",
                "RESUME_GRACE": str(RESUME_GRACE),
                "MAX_HEADER_BYTES": str(MAX_HEADER_BYTES), "HEADER_TIMEOUT": str(HEADER_TIMEOUT),
                "BODY_TIMEOUT": str(BODY_TIMEOUT), "NAMESPACE": "limits"}
    with sim_stack(1, **settings) as running:
        yield running
        assert running.stack.exited() == []


def address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 80


def running_sequences(url: str) -> int:
    return httpx.get(f"{url}/health").json()["running"]


def in_flight(stack: PrivateStack, key: str) -> int:
    tenant = hashlib.sha256(key.encode()).hexdigest()[:16]
    return redis.Redis.from_url(stack.redis_url).zcard(Keys("limits").in_flight(tenant))


def post_head(path: str, body: bytes, headers: dict[str, str], length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             f"Content-Length: {len(body) if length is None else length}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    """What arrives until `marker` has, the server closes, or `timeout` passes."""
    sock.settimeout(timeout)
    received = b""
    deadline = time.monotonic() + timeout
    while marker not in received and time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        received += chunk
    return received


def test_a_client_that_stops_reading_is_cancelled_past_its_buffer(limits: PrivateStack) -> None:
    sock = socket.socket()
    # A small receive window, so that the server's send path fills within seconds.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(limits.url))
    with sock:
        body = json.dumps(LONG).encode()
        sock.sendall(post_head("/v1/chat/completions", body, ALPHA) + body)
        wait_for(lambda: running_sequences(limits.url) == KEY_MAX_REQUESTS, 10, "the slow client's choices to run")
        assert in_flight(limits, "alpha") == KEY_MAX_REQUESTS
        started = time.monotonic()
        # Each choice would run 8,000 steps; the buffer overflows long before, and every slot is freed.
        wait_for(lambda: running_sequences(limits.url) == 0, 30, "the slow client's requests to be cancelled")
        print(f"cancelled {time.monotonic() - started:.1f} s after the choices ran")
        assert in_flight(limits, "alpha") == 0
        # The client reads at last: what the sockets held, then the error, then the end of the stream.
        received = read_until(sock, b"data: [DONE]", 30)
    assert received.startswith(b"HTTP/1.1 200")
    error = json.loads(received.split(b"data: ")[-2].split(b"\n")[0])["error"]
    assert error["code"] == "client_too_slow" and error["type"] == "invalid_request_error"
    assert httpx.post(f"{limits.url}/generate", json=SHORT, headers=ALPHA, timeout=30).status_code == 200


@contextmanager
def endless_headers(url: str) -> Iterator[dict[str, list[float]]]:
    """Connections that each send one header forever, one after another while the block runs;
    yields, per connection, the bytes it got out (into the sockets' buffers) and the seconds it
    took until the gateway cut it off, and whether it saw the 431."""
    stop = threading.Event()
    seen: dict[str, list[float]] = {"sent": [], "seconds": [], "refused": []}

    def attack() -> None:
        while not stop.is_set():
            sock = socket.create_connection(address(url), timeout=10)
            sent, started = 0, time.monotonic()
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Endless: ")
                while not stop.is_set() and time.monotonic() - started < 20:
                    sock.sendall(b"a" * 1024)
                    sent += 1024
                continue  # still open when told to stop: not cut off
            except OSError:
                pass
            seen["sent"].append(sent)
            seen["seconds"].append(time.monotonic() - started)
            seen["refused"].append(float(b"431" in read_until(sock, b"}", 1)))
            sock.close()

    thread = threading.Thread(target=attack)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(30)


def test_an_endless_header_is_cut_off_while_others_are_served(limits: PrivateStack) -> None:
    with httpx.Client(base_url=limits.url, timeout=30, headers=ALPHA) as client:
        def served() -> float:
            started = time.monotonic()
            with client.stream("POST", "/generate_stream", json={"prompt": "hi", "max_tokens": 20}) as response:
                assert response.status_code == 200
                assert b"finish_reason" in response.read()
            return time.monotonic() - started

        alone = statistics.median(served() for _ in range(5))
        with endless_headers(limits.url) as seen:
            wait_for(lambda: seen["sent"], 10, "the first endless header to be cut off")
            cut = len(seen["sent"])
            flooded = statistics.median(served() for _ in range(5))
            assert len(seen["sent"]) > cut, "the flood went on while the streams were served"
    print(f"endless headers: {len(seen['sent'])} connections cut off after at most {max(seen['sent'])} bytes, "
          f"{max(seen['seconds']):.2f} s; {sum(seen['refused']):.0f} saw the 431; a stream took {flooded:.2f} s "
          f"meanwhile, {alone:.2f} s before")
    assert flooded < 4 * alone  # served about as fast: the flood takes no more than its share of the gateway
    assert len(seen["sent"]) >= 2
    assert max(seen["seconds"]) < 5
    assert sum(seen["refused"]) >= 1  # most see the 431 before the close (a reset may swallow it)


def test_a_head_that_is_too_slow_gets_408_and_the_connection_closes(limits: PrivateStack) -> None:
    with socket.create_connection(address(limits.url)) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        answer = read_until(sock, b"\x00", HEADER_TIMEOUT + 5)
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer
    assert HEADER_TIMEOUT - 0.5 < time.monotonic() - started < HEADER_TIMEOUT + 3


def test_a_connection_that_sends_nothing_is_closed(limits: PrivateStack) -> None:
    with socket.create_connection(address(limits.url)) as sock:
        started = time.monotonic()
        read_until(sock, b"\x00", HEADER_TIMEOUT + 5)
    assert time.monotonic() - started < HEADER_TIMEOUT + 3


def test_headers_over_the_limit_in_one_piece_get_431(limits: PrivateStack) -> None:
    response = httpx.get(f"{limits.url}/health", headers={"X-Big": "a" * (MAX_HEADER_BYTES + 1)}, timeout=10)
    assert response.status_code == 431 and response.json()["error"]["code"] == "headers_too_large"
    assert httpx.get(f"{limits.url}/health", headers={"X-Fine": "a" * 1024}, timeout=10).status_code == 200


def test_bytes_that_are_not_http_get_a_json_400(limits: PrivateStack) -> None:
    with socket.create_connection(address(limits.url)) as sock:
        sock.sendall(b"HELLO THERE\r\n\r\n")
        answer = read_until(sock, b"\x00", 5)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_value", answer


def test_a_body_that_is_too_slow_gets_408(limits: PrivateStack) -> None:
    body = json.dumps(SHORT).encode()
    with socket.create_connection(address(limits.url)) as sock:
        started = time.monotonic()
        sock.sendall(post_head("/generate", body, ALPHA) + body[:10])
        answer = read_until(sock, b"\x00", BODY_TIMEOUT + 5)
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer
    assert BODY_TIMEOUT - 0.5 < time.monotonic() - started < BODY_TIMEOUT + 3


def test_a_key_over_its_limit_gets_429_while_another_key_is_served(limits: PrivateStack) -> None:
    with httpx.Client(base_url=limits.url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=LONG, headers=ALPHA) as long:
            assert long.status_code == 200
            assert in_flight(limits, "alpha") == KEY_MAX_REQUESTS  # each choice counts
            refused = client.post("/generate", json=SHORT, headers=ALPHA)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "key_limit"
            assert client.post("/generate", json=SHORT, headers=BETA).status_code == 200
        # Leaving the stream ends its requests RESUME_GRACE later (unless it is resumed), and with them their
        # count against the key.
        wait_for(lambda: in_flight(limits, "alpha") == 0, RESUME_GRACE + 5, "alpha's requests to stop counting")
        assert client.post("/generate", json=SHORT, headers=ALPHA).status_code == 200
        too_many = client.post("/v1/chat/completions", json={**LONG, "n": KEY_MAX_REQUESTS + 1, "stream": False},
                               headers=BETA)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    wait_for(lambda: running_sequences(limits.url) == 0, 10, "the cancelled choices to leave the worker")


MAX_QUEUE_BYTES = 1500


@pytest.fixture(scope="module")
def lone() -> Iterator[tuple[str, redis.Redis]]:
    """A gateway alone on a Redis of its own: what it admits stays queued, and Redis can be filled."""
    with redis_server() as redis_url:
        port = free_port()
        stack = Stack({**os.environ, "REDIS_URL": redis_url, "GATEWAY_HOST": "127.0.0.1", "GATEWAY_PORT": str(port),
                       "NAMESPACE": "lone", "MAX_QUEUE_BYTES": str(MAX_QUEUE_BYTES), "LOG_LEVEL": "WARNING"})
        stack.spawn("gateway")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: responds(f"{url}/health"), 30, "the lone gateway")
            yield url, redis.Redis.from_url(redis_url)
            assert stack.exited() == []
        finally:
            stack.stop()


def _wait_in_queue(url: str, body: dict[str, object]) -> threading.Thread:
    """A request that waits (no scheduler takes it) until its client gives up."""
    def wait() -> None:
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", json=body, timeout=3)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def test_the_queue_is_bounded_in_bytes(lone: tuple[str, redis.Redis]) -> None:
    url, client = lone
    keys = Keys("lone")
    waiting = _wait_in_queue(url, {"prompt": "x" * 600, "max_tokens": 2})
    try:
        wait_for(lambda: client.get(keys.queued_bytes), 5, "the first request to be queued")
        # What the gateway counts is what the scheduler reads: the payload of each request's stream entry.
        [(_, fields)] = client.xrange(keys.requests)
        assert int(client.get(keys.queued_bytes)) == len(fields[PAYLOAD])
        assert int(client.get(keys.queued)) == 1
        refused = httpx.post(f"{url}/generate", json={"prompt": "y" * 1000, "max_tokens": 2}, timeout=10)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "MAX_QUEUE_BYTES" in error["message"]
    finally:
        waiting.join()


def test_a_redis_that_refuses_writes_is_a_503_redis_full(lone: tuple[str, redis.Redis]) -> None:
    url, client = lone
    # No scheduler takes the earlier tests' requests: they would refuse this one for want of room (a 429) before
    # Redis is asked for a write.
    keys = Keys("lone")
    client.delete(keys.requests, keys.queued, keys.queued_bytes)
    client.config_set("maxmemory", "1")
    try:
        response = httpx.post(f"{url}/generate", json=SHORT, timeout=10)
    finally:
        client.config_set("maxmemory", "0")
    assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
    assert response.json()["error"]["code"] == "redis_full"
    assert httpx.get(f"{url}/health").status_code == 200
