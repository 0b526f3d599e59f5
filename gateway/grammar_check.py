"""A request's grammar built and checked out of the gateway's process: llguidance compiles it in native
code, where a grammar deep enough overflows the stack and takes the whole process with it. `compiled` runs
in a sandboxed child (common/sandbox.py); a grammar that makes it fail, crash or run too long is a 400
naming the field, and the gateway and its other streams go on.

What reaches the child has passed common/grammar.py's bounds on size and nesting; inside, the grammar is
validated and then probed (common/grammar.probe) for a parse too wide to enforce."""

from __future__ import annotations

import json

import msgspec

from common import grammar, toolcalls
from common.grammar import GrammarError
from common.protocol import Tool
from common.sandbox import Failed, Limits, Refused, Sandbox

CHECKERS = 2
# The compiler's stack here is half what a thread gets by default (8 MiB on Linux): a grammar that compiles
# here compiles in the worker, which enforces it.
LIMITS = Limits(seconds=5.0, memory_bytes=1 << 30, stack_bytes=4 << 20)


def source(kind: str, value: object) -> str:
    """The text the client gave for a constraint of `kind`, for its bounds."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except RecursionError:
        raise GrammarError(f"the {kind} nests too deeply; at most {grammar.MAX_NESTING} levels are accepted") \
            from None


def tools_source(tools: list[Tool]) -> str:
    return "".join(tool.name + tool.parameters for tool in tools)


def compiled(kind: str, value: object) -> str:
    """The checked grammar of a constraint (the sandboxed job). Raises GrammarError with the reason."""
    built = _build(kind, value)
    grammar.checked(built)
    grammar.probe(built)
    return built


def _build(kind: str, value: object) -> str:
    if kind == "json":
        return grammar.json_schema(_schema(value))
    if kind == "json_object":
        return grammar.any_json_object()
    if kind == "regex":
        return grammar.regex(str(value))
    if kind == "choice":
        return grammar.choice(list(value))  # type: ignore[call-overload]
    if kind == "tools":
        call = msgspec.convert(value, ToolsCall)
        return toolcalls.grammar(call.tools, call.only, call.required, call.parallel)
    return grammar.lark(str(value))


def _schema(value: object) -> dict | bool:
    """A schema given as JSON text (as vLLM allows) or as an object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise GrammarError("the JSON schema is not valid JSON") from None
    return value  # type: ignore[return-value]


class ToolsCall(msgspec.Struct):
    tools: list[Tool]
    only: str | None
    required: bool
    parallel: bool


class GrammarChecker:
    """The gateway's sandboxed compiler of grammars: `check` returns the grammar or raises GrammarError."""

    def __init__(self) -> None:
        self.sandbox = Sandbox(f"{__name__}:compiled", CHECKERS, LIMITS)

    async def start(self) -> None:
        await self.sandbox.start()

    async def stop(self) -> None:
        await self.sandbox.close()

    async def check(self, kind: str, value: object) -> str:
        try:
            return str(await self.sandbox.run(kind, value))
        except Refused as exc:
            raise GrammarError(str(exc)) from None
        except Failed as exc:
            raise GrammarError(f"compiling it {exc}: it is too large or nests too deeply (rules that each refer to "
                               f"the next nest too) for the compiler's {LIMITS.stack_bytes >> 20} MiB stack and "
                               f"{LIMITS.seconds:g} s") from None
