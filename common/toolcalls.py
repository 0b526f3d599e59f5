"""Function calling in one format, from the prompt to the answer: the worker tells a model whose chat
template knows no tools about them in these words; the gateway builds the grammar every answer keeps to
and reads the calls back out of the text as it streams.

A call is written as `<tool_call>` tags around `{"name": ..., "arguments": ...}` (the tags many open
models are trained on). The grammar makes every call parse: its name is one of the tools' names and its
arguments keep to that tool's schema. With `auto`, an answer is either free text, which may not start
with "<", or calls; with `required` or a named tool, it is calls only."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from common import grammar as grammars
from common.protocol import ChatMessage, Tool, ToolCall

OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
BETWEEN = "\n"


def tool_json(tool: Tool) -> dict:
    """The tool as OpenAI spells it (and as chat templates take it)."""
    function: dict = {"name": tool.name, "parameters": json.loads(tool.parameters)}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def system_text(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(tool_json(tool)) for tool in tools)
    return ("You can call functions. They are described here as JSON schemas:\n<tools>\n" + lines + "\n</tools>\n"
            "To call one, answer with its name and arguments as a JSON object between tags, one block per call:\n"
            + OPEN + '{"name": "<function name>", "arguments": {<its arguments>}}' + CLOSE)


def call_text(call: ToolCall) -> str:
    return OPEN + f'{{"name": {json.dumps(call.name)}, "arguments": {call.arguments or "{}"}}}' + CLOSE


def plain_messages(messages: list[ChatMessage], tools: list[Tool]) -> list[dict[str, str]]:
    """The conversation for a chat template without tools: the tools told in the system message, earlier
    calls written out as the model would write them, and tools' answers as the user's words."""
    rendered = []
    for message in messages:
        content = message.content
        if message.tool_calls:
            content = BETWEEN.join(([content] if content else []) + [call_text(c) for c in message.tool_calls])
        role = message.role
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        rendered.append({"role": role, "content": content})
    if tools:
        told = system_text(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + told}
        else:
            rendered.insert(0, {"role": "system", "content": told})
    return rendered


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation for a chat template that takes tools: OpenAI's own shapes."""
    rendered = []
    for message in messages:
        entry: dict = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")}}
                                   for c in message.tool_calls]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def grammar(tools: list[Tool], only: str | None, required: bool, parallel: bool) -> str:
    """The grammar of an answer: calls of `tools`, one or (if `parallel`) several; unless `required`, free
    text instead. A named tool (`only`) is one call of it, as OpenAI forces it."""
    chosen = [tool for tool in tools if only is None or tool.name == only]
    schema = {"anyOf": [_call_schema(tool) for tool in chosen]} if len(chosen) > 1 else _call_schema(chosen[0])
    call = f'"{_lark_escape(OPEN)}" %json {json.dumps(schema)} "{_lark_escape(CLOSE)}"'
    calls = f'call ("{_lark_escape(BETWEEN)}" call)*' if parallel and only is None else "call"
    start = "calls" if required or only is not None else "TEXT | calls"
    return grammars.lark(f"start: {start}\ncalls: {calls}\ncall: {call}\nTEXT: /[^<][\\s\\S]*/\n")


def _call_schema(tool: Tool) -> dict:
    arguments = grammars.closed(json.loads(tool.parameters))
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": grammars.JSON_OPTIONS}


def _lark_escape(text: str) -> str:
    return json.dumps(text)[1:-1]


# What parsing an answer yields, in order.
@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments

_HEAD = re.compile(r'\s*' + re.escape(OPEN) + r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


@dataclass
class CallParser:
    """Reads an answer as it streams: free text, or calls (the grammar guarantees their shape). `feed`
    returns what the text so far adds; nothing is held back longer than the shape needs to tell it."""

    buffer: str = ""
    mode: str = "start"  # start, text, head (before a call's arguments), arguments, tail (after them)
    calls: int = 0  # calls read to their end
    started: int = 0  # calls whose name has been read
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer and self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        """Move on as far as the buffer allows; False once it must wait for more text."""
        if self.mode == "start":  # text never starts with "<", calls always do
            self.mode = "head" if self.buffer.startswith("<") else "text"
            return True
        if self.mode == "text":
            events.append(Content(self.buffer))
            self.buffer = ""
            return False
        if self.mode == "head":
            match = _HEAD.match(self.buffer)
            if match is None:
                return False
            events.append(CallStart(self.calls, json.loads(match.group(1))))
            self.started += 1
            self.buffer = self.buffer[match.end():]
            self.mode, self.depth, self.in_string, self.escaped = "arguments", 0, False, False
            return True
        if self.mode == "arguments":
            return self._arguments(events)
        end = self.buffer.find(CLOSE)  # tail: the call's closing brace and tag
        if end < 0:
            return False
        self.buffer = self.buffer[end + len(CLOSE):]
        self.calls += 1
        self.mode = "head"
        return True

    def _arguments(self, events: list[Event]) -> bool:
        """The arguments' JSON runs until the call object's own closing brace, outside any string."""
        for position, char in enumerate(self.buffer):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                if self.depth == 0:
                    if position:
                        events.append(Arguments(self.calls, self.buffer[:position]))
                    self.buffer = self.buffer[position:]
                    self.mode = "tail"
                    return True
                self.depth -= 1
        events.append(Arguments(self.calls, self.buffer))
        self.buffer = ""
        return False

    def finish(self) -> list[Event]:
        """What is left once the answer has ended (text only: a call cut short stays unread)."""
        if self.mode == "text" and self.buffer:
            events: list[Event] = [Content(self.buffer)]
            self.buffer = ""
            return events
        return []


@dataclass
class ParsedAnswer:
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments JSON)


def parse(events: Iterable[Event]) -> ParsedAnswer:
    """A whole answer from its events."""
    text, calls = [], []
    for event in events:
        if isinstance(event, Content):
            text.append(event.text)
        elif isinstance(event, CallStart):
            calls.append([event.name, ""])
        else:
            calls[event.index][1] += event.text
    return ParsedAnswer("".join(text) if text else None, [(name, arguments) for name, arguments in calls])


def call_id(request_id: str, index: int) -> str:
    """The same id for the same call in a whole answer, a stream and its resumption."""
    return f"call_{request_id[:20]}{index}"
