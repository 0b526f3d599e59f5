"""What a request's answer must keep to, as one grammar for its worker: OpenAI's response_format, vLLM's
structured_outputs (and its older guided_* fields), or the tool calls a chat request allows. The field's
text is bounded here, and its grammar built and checked in a sandbox (gateway/grammar_check.py), so that a
schema no worker could enforce is a 400 with its reason, and one that would crash its compiler crashes
only the sandbox."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from common import grammar
from common.errors import ErrorCode
from common.grammar import GrammarError
from common.protocol import Tool
from gateway.chat_schemas import ChatCompletionRequest, NamedToolChoice
from gateway.errors import ApiError
from gateway.grammar_check import GrammarChecker, source, tools_source
from gateway.schemas import OpenAIFields


@dataclass
class Constraint:
    grammar: str = ""
    tools: list[Tool] | None = None  # offered to the model (tool_choice not 'none')
    param: str = ""


@dataclass
class Spec:
    """A constraint as the client gave it, before anything native has read it."""

    param: str
    kind: str  # json, json_object, regex, choice, grammar, tools
    value: object
    text: str  # what its bounds apply to
    tools: list[Tool] | None = None


async def constraint_of(request: Request, body: OpenAIFields) -> Constraint:
    """The request's constraint, checked; raises ApiError 400 naming the field."""
    spec = _spec(body)
    if spec is None:
        return Constraint()
    checker: GrammarChecker = request.app.state.grammars
    try:
        grammar.bounded(spec.text, _what(spec.kind))
        built = await checker.check(spec.kind, spec.value)
    except GrammarError as exc:
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"{spec.param} cannot be enforced: {exc}", spec.param) \
            from None
    return Constraint(built, spec.tools, spec.param)


def _what(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON schema", "tools": "tools' parameters"}.get(kind, kind)


def _spec(body: OpenAIFields) -> Spec | None:
    sources = _sources(body)
    chat_tools = isinstance(body, ChatCompletionRequest) and body.calls_tools()
    if len(sources) + chat_tools > 1:
        names = list(sources) + (["tools"] if chat_tools else [])
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"give at most one of {', '.join(names)}: each constrains the "
                          "whole answer", names[-1])
    if chat_tools:
        return _tools(body)
    if not sources:
        return None
    param, (kind, value) = next(iter(sources.items()))
    try:
        return Spec(param, kind, value, source(kind, value))
    except GrammarError as exc:
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"{param} cannot be enforced: {exc}", param) from None


def _sources(body: OpenAIFields) -> dict[str, tuple[str, object]]:
    """Each field that constrains the answer: its kind and its value."""
    sources: dict[str, tuple[str, object]] = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        sources["response_format"] = ("json_object", None)
    elif fmt is not None and fmt.type == "json_schema":
        sources["response_format"] = ("json", fmt.json_schema.json_schema)
    outputs = body.structured_outputs
    given = {
        "json": outputs.json_ if outputs else None, "regex": outputs.regex if outputs else None,
        "choice": outputs.choice if outputs else None, "grammar": outputs.grammar if outputs else None,
        "json_object": outputs.json_object or None if outputs else None,
    }
    for name, value in given.items():
        if value is not None:
            sources[f"structured_outputs.{name}"] = (name, value)
    legacy = {"json": body.guided_json, "regex": body.guided_regex, "choice": body.guided_choice,
              "grammar": body.guided_grammar}
    for name, value in legacy.items():
        if value is not None:
            sources[f"guided_{name}"] = (name, value)
    return sources


def _tools(body: ChatCompletionRequest) -> Spec:
    tools = [t.tool() for t in body.tools]
    only = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    value = {"tools": tools, "only": only, "required": body.tool_choice == "required",
             "parallel": body.parallel_tool_calls}
    return Spec("tools", "tools", value, tools_source(tools), tools)
