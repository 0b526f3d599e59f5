"""What a request's answer must keep to, as one grammar for its worker: OpenAI's response_format, vLLM's
structured_outputs (and its older guided_* fields), or the tool calls a chat request allows. The grammar is
checked here, off the event loop, so that a schema no worker could enforce is a 400 with its reason."""

from __future__ import annotations

import json
from dataclasses import dataclass

import anyio

from common import grammar, toolcalls
from common.errors import ErrorCode
from common.grammar import GrammarError
from common.protocol import Tool
from gateway.errors import ApiError
from gateway.schemas import ChatCompletionRequest, NamedToolChoice, OpenAIFields


@dataclass
class Constraint:
    grammar: str = ""
    tools: list[Tool] | None = None  # offered to the model (tool_choice not 'none')
    param: str = ""


async def constraint_of(body: OpenAIFields) -> Constraint:
    """The request's constraint, checked; raises ApiError 400 naming the field."""
    built = _build(body)
    if built.grammar:
        try:
            await anyio.to_thread.run_sync(grammar.checked, built.grammar)
        except GrammarError as exc:
            raise ApiError.of(ErrorCode.INVALID_VALUE, f"{built.param} cannot be enforced: {exc}", built.param) \
                from None
    return built


def _build(body: OpenAIFields) -> Constraint:
    sources = _sources(body)
    chat_tools = isinstance(body, ChatCompletionRequest) and body.calls_tools()
    if len(sources) + chat_tools > 1:
        names = list(sources) + (["tools"] if chat_tools else [])
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"give at most one of {', '.join(names)}: each constrains the "
                          "whole answer", names[-1])
    try:
        if chat_tools:
            return _tools(body)
        if sources:
            param, build = next(iter(sources.items()))
            return Constraint(build(), param=param)
    except GrammarError as exc:
        param = "tools" if chat_tools else next(iter(sources))
        raise ApiError.of(ErrorCode.INVALID_VALUE, str(exc), param) from None
    return Constraint()


def _sources(body: OpenAIFields) -> dict:
    """Each field that constrains the answer, with how to build its grammar."""
    sources = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        sources["response_format"] = grammar.any_json_object
    elif fmt is not None and fmt.type == "json_schema":
        sources["response_format"] = lambda: grammar.json_schema(fmt.json_schema.json_schema)
    outputs = body.structured_outputs
    given = {
        "json": outputs.json_ if outputs else None, "regex": outputs.regex if outputs else None,
        "choice": outputs.choice if outputs else None, "grammar": outputs.grammar if outputs else None,
        "json_object": outputs.json_object or None if outputs else None,
    }
    for name, value in given.items():
        if value is not None:
            sources[f"structured_outputs.{name}"] = _builder(name, value)
    legacy = {"json": body.guided_json, "regex": body.guided_regex, "choice": body.guided_choice,
              "grammar": body.guided_grammar}
    for name, value in legacy.items():
        if value is not None:
            sources[f"guided_{name}"] = _builder(name, value)
    return sources


def _builder(kind: str, value: object):
    if kind == "json":
        return lambda: grammar.json_schema(_schema(value))
    if kind == "json_object":
        return grammar.any_json_object
    if kind == "regex":
        return lambda: grammar.regex(value)
    if kind == "choice":
        return lambda: grammar.choice(value)
    return lambda: grammar.lark(value)


def _schema(value: object) -> dict | bool:
    """A schema given as JSON text (as vLLM allows) or as an object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise GrammarError("the JSON schema is not valid JSON") from None
    return value


def _tools(body: ChatCompletionRequest) -> Constraint:
    tools = [t.tool() for t in body.tools]
    only = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    built = toolcalls.grammar(tools, only, required=body.tool_choice == "required",
                              parallel=body.parallel_tool_calls)
    return Constraint(built, tools, "tools")
