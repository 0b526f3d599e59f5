"""The tool-call format and the constraints built from requests, without a stack: the parser reads calls
out of text however it is split, the grammars accept what the parser reads and refuse what breaks a schema,
and a bad schema or a clash of constraints is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from common import grammar, toolcalls
from common.protocol import ChatMessage, Tool, ToolCall
from gateway.chat_schemas import ChatCompletionRequest
from gateway.constraints import constraint_of
from gateway.errors import ApiError
from gateway.grammar_check import GrammarChecker
from gateway.schemas import CompletionRequest

WEATHER = Tool("get_weather", "The weather of a city", json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
     "required": ["city"], "additionalProperties": False}))
CLOCK = Tool("get_time", "", json.dumps({"type": "object", "properties": {}, "additionalProperties": False}))
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "c"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.fixture(scope="module")
def index(tokenizer):
    return tokenizer, from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def accepts(index, built: str, text: str) -> bool:
    tokenizer, lltokenizer = index
    matcher = LLMatcher(lltokenizer, built)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def read(text: str, pieces: int) -> toolcalls.ParsedAnswer:
    parser, events, cuts = toolcalls.CallParser(), [], sorted(random.sample(range(1, len(text)), pieces))
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += parser.feed(text[start:end])
    return toolcalls.parse(events + parser.finish())


def test_calls_are_read_whole_however_the_text_is_split() -> None:
    random.seed(7)
    for _ in range(200):
        answer = read(TWO_CALLS, random.randint(1, 40))
        assert answer.content is None
        assert answer.calls == [("get_weather", '{"city": "Pa\\"ris}", "unit": "c"}'), ("get_time", "{}")]


def test_free_text_is_content_even_with_a_tag_inside_it() -> None:
    random.seed(8)
    text = " An answer with <tool_call> in it, and {braces}."
    assert read(text, 5) == toolcalls.ParsedAnswer(text, [])


def test_the_grammar_takes_what_the_parser_reads_and_refuses_a_bad_call(index) -> None:
    auto = grammar.checked(toolcalls.grammar([WEATHER, CLOCK], None, required=False, parallel=True))
    assert accepts(index, auto, TWO_CALLS)
    assert accepts(index, auto, "Just words, no call.")
    assert not accepts(index, auto, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Rome"}}\n</tool_call>')
    assert not accepts(index, auto, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    required = grammar.checked(toolcalls.grammar([WEATHER, CLOCK], None, required=True, parallel=False))
    assert not accepts(index, required, "Just words, no call.")
    assert not accepts(index, required, TWO_CALLS), "one call only without parallel_tool_calls"
    named = grammar.checked(toolcalls.grammar([WEATHER, CLOCK], "get_time", required=False, parallel=True))
    assert accepts(index, named, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(index, named, TWO_CALLS), "a named tool is one call of it"


def test_json_is_written_with_fixed_separators(index) -> None:
    built = grammar.checked(grammar.json_schema({"type": "object", "properties": {"a": {"type": "array"}}}))
    assert accepts(index, built, '{"a": [1, 2]}')
    assert not accepts(index, built, '{ "a":[1,2] }')
    assert not accepts(index, built, '{"a": [1, 2]}\n\n')


def test_a_template_without_tools_is_told_of_them_and_of_earlier_calls() -> None:
    messages = [ChatMessage("user", "Weather in Rome?"),
                ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Rome"}'),)),
                ChatMessage("tool", "21 C", tool_call_id="call_1")]
    rendered = toolcalls.plain_messages(messages, [WEATHER])
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    assert toolcalls.plain_messages([ChatMessage("user", "hi")], []) == [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def constrain(body):
    """The body's constraint, built as the gateway builds it: in a sandboxed child."""

    async def run():
        checker = GrammarChecker()
        try:
            return await constraint_of(SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(grammars=checker))),
                                       body)
        finally:
            await checker.stop()

    return asyncio.run(run())


def refusal(body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        constrain(body)
    assert caught.value.status == 400 and caught.value.code == "invalid_value"
    return caught.value


def test_each_way_of_asking_builds_a_checked_grammar() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    asks = [{"response_format": {"type": "json_object"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            {"structured_outputs": {"json": schema}}, {"structured_outputs": {"json": json.dumps(schema)}},
            {"structured_outputs": {"regex": "[a-z]+"}}, {"structured_outputs": {"choice": ["yes", "no"]}},
            {"structured_outputs": {"grammar": 'start: "a" | "b"'}},
            {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"structured_outputs": {"json_object": True}},
            {"guided_json": schema}, {"guided_regex": "[0-9]{3}"}, {"guided_choice": ["a"]},
            {"guided_grammar": 'start: "x"'}]
    for ask in asks:
        built = constrain(CompletionRequest(model="m", prompt="p", **ask))
        assert built.grammar and grammar.problem(built.grammar) is None, ask
    assert constrain(chat(response_format={"type": "text"})).grammar == ""
    told = constrain(chat(tools=[{"type": "function", "function": {"name": "f"}}]))
    assert told.grammar and [t.name for t in told.tools] == ["f"]
    unused = constrain(chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none"))
    assert unused.grammar == "" and unused.tools is None


def test_what_cannot_be_enforced_is_a_400_naming_the_field() -> None:
    bad_type = refusal(chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}))
    assert bad_type.param == "response_format" and "strin" in bad_type.message
    assert refusal(chat(structured_outputs={"regex": "[a-"})).param == "structured_outputs.regex"
    assert refusal(chat(guided_grammar="start: nowhere")).param == "guided_grammar"
    assert refusal(chat(structured_outputs={"json": "{not json"})).param == "structured_outputs.json"
    bad_ref = refusal(chat(guided_json={"$ref": "#/nope"}))
    assert "nope" in bad_ref.message
    bad_tool = refusal(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nah"}}}]))
    assert bad_tool.param == "tools"
    both = refusal(chat(response_format={"type": "json_object"}, guided_regex="a"))
    assert "at most one" in both.message
    refusal(chat(response_format={"type": "json_object"}, tools=[{"type": "function", "function": {"name": "f"}}]))


def test_tool_fields_are_checked_as_they_are_read() -> None:
    with pytest.raises(ValueError, match="not among"):
        chat(tools=[{"type": "function", "function": {"name": "f"}}],
             tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(ValueError, match="distinct"):
        chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2)
    with pytest.raises(ValueError, match="needs 'tools'"):
        chat(tool_choice="required")
    with pytest.raises(ValueError, match="content"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="name"):
        chat(tools=[{"type": "function", "function": {"name": "has space"}}])


def test_objects_that_list_their_properties_are_closed_unless_they_say_otherwise(index) -> None:
    open_inside = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                                    "c": {"type": "object", "additionalProperties": True}},
                   "$defs": {"d": {"properties": {"e": {"type": "string"}}}}}
    shut = grammar.closed(open_inside)
    assert shut["additionalProperties"] is False and shut["properties"]["a"]["additionalProperties"] is False
    assert shut["properties"]["c"]["additionalProperties"] is True
    assert shut["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in open_inside, "the client's schema is left as it was"
    built = grammar.checked(grammar.json_schema(open_inside))
    assert accepts(index, built, '{"a": {"b": 1}, "c": {"x": 2}}')
    assert not accepts(index, built, '{"a": {"b": 1, "z": 2}}')
    assert not accepts(index, built, '{"z": 1}')
