"""Schema-driven fuzzing of every route with schemathesis, against the app's own
OpenAPI spec on the real stack: valid and invalid bodies alike, no 5xx and no hang."""

from __future__ import annotations

import hypothesis
import schemathesis
from schemathesis.generation import GenerationMode
from schemathesis.schemas import APIOperation

from tests.conftest import RunningStack

# Generation lengths are capped so that a few hundred cases fit the CPU's time, and
# queue timeouts get a floor, since a request whose own deadline passes is rightly
# answered 503 queue_timeout; everything else (types, ranges, missing and extra
# fields) is left to the fuzzer.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}
TIMEOUT_FLOOR = 30.0
# A chat answer without a token limit runs to end-of-sequence, which a grammar may allow only much later (a
# string the model never closes): such a body gets a limit too, since it would run to the model's context.
CONSTRAINTS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "tools"}
EXAMPLES_PER_ROUTE_AND_MODE = 40


def _cap(body: object) -> None:
    if not isinstance(body, dict):
        return
    for field, cap in CAPS.items():
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap
    if CONSTRAINTS & body.keys() and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = CAPS["max_completion_tokens"]
    timeout = body.get("timeout")
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout < TIMEOUT_FLOOR:
        body["timeout"] = TIMEOUT_FLOOR
    for field in ("prompt", "prompts"):
        if isinstance(body.get(field), list):
            body[field] = body[field][:2]


def fuzz(operation: APIOperation, mode: GenerationMode, tried: dict[str, int]) -> None:
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(max_examples=EXAMPLES_PER_ROUTE_AND_MODE, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(case: schemathesis.Case) -> None:
        _cap(case.body)
        response = case.call(timeout=60)
        tried[operation.label] = tried.get(operation.label, 0) + 1
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["message"]

    check()


def test_no_input_gets_a_server_error_or_hangs(stack: RunningStack) -> None:
    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    tried: dict[str, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        fuzz(operation, GenerationMode.POSITIVE, tried)
        # A route without a body (a GET, the cancel of a batch job) has no invalid input to make.
        if operation.method.upper() == "POST" and len(operation.body):
            fuzz(operation, GenerationMode.NEGATIVE, tried)
    print(f"fuzzed: {tried}")
    assert set(tried) == {operation.label for operation in operations}
