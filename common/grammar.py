"""Constraints on what a request may generate, as llguidance grammars. The gateway builds and checks
them (a bad schema is a 400 before any worker sees it); the worker enforces them token by token
(worker/grammar.py). One library on both sides, so what the gateway accepts the worker can run.

JSON is generated with fixed separators and no other whitespace: the text reads like `json.dumps`, and a
small model cannot spend its tokens on an endless run of blanks between two values."""

from __future__ import annotations

import json

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import any_to_lark

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

# Bounds on what a client may ask to be enforced, checked in Python before any native code reads it: the
# source of a schema (as JSON), regex or grammar (all tools' parameters together), and its nesting of
# brackets and parentheses.
MAX_SOURCE_BYTES = 128 << 10
MAX_NESTING = 64
# The Earley items one step of a parse may hold: on a probe at admission (llguidance's default), and where
# the grammar is enforced, twice that, so that another path of the same grammar, which may need more (the
# parse grows with what was generated), still fits.
PROBED_ROW_ITEMS = 2000
ENFORCED_ROW_ITEMS = 2 * PROBED_ROW_ITEMS
PROBE_STEPS = 64


class GrammarError(ValueError):
    """A schema, pattern or grammar that cannot be enforced; the message says why."""


def json_schema(schema: dict | bool) -> str:
    if not isinstance(schema, dict | bool):
        raise GrammarError("a JSON schema must be an object (or true)")
    try:
        return LLMatcher.grammar_from_json_schema(closed(schema), overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "unevaluatedItems")
_MANY = ("anyOf", "allOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: object) -> object:
    """`schema` with every object that lists its properties closed to others unless it says otherwise, as
    OpenAI's strict mode requires and vLLM's default grammar backend assumes: a model left free to add keys
    tends to add them until it runs out of tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed(item) for item in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(item) for name, item in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    elif "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def any_json_object() -> str:
    return json_schema({"type": "object"})


def regex(pattern: str) -> str:
    return LLMatcher.grammar_from_regex(pattern)


def lark(text: str) -> str:
    """A Lark grammar; one written in GBNF (llama.cpp's, with `::=`) is translated first."""
    try:
        text = any_to_lark(text)
    except Exception as exc:  # the translator raises several kinds on bad input
        raise GrammarError(f"the GBNF grammar cannot be read: {exc}") from None
    return LLMatcher.grammar_from_lark(text)


def choice(options: list[str]) -> str:
    """Exactly one of `options`, verbatim."""
    if not options:
        raise GrammarError("a choice needs at least one option")
    return lark("start: " + " | ".join(json.dumps(option) for option in options))


def problem(grammar: str) -> str | None:
    """Why `grammar` cannot be enforced, or None. Building it costs up to milliseconds for large schemas."""
    message = LLMatcher.validate_grammar(grammar)
    return message or None


def checked(grammar: str) -> str:
    """`grammar`, or GrammarError with llguidance's reason."""
    reason = problem(grammar)
    if reason:
        raise GrammarError(reason.strip())
    return grammar


def bounded(source: str, what: str) -> None:
    """GrammarError unless `source` (the text of a schema, regex or grammar) is within MAX_SOURCE_BYTES and
    MAX_NESTING. Iterative, and blind to what the brackets mean: quoted brackets count too."""
    size = len(source.encode())
    if size > MAX_SOURCE_BYTES:
        raise GrammarError(f"the {what} is {size} bytes; at most {MAX_SOURCE_BYTES} are accepted")
    depth = deepest = 0
    for char in source:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    if deepest > MAX_NESTING:
        raise GrammarError(f"the {what} nests {deepest} levels of brackets; at most {MAX_NESTING} are accepted")


class _Bytes:
    """A tokenizer of single bytes (and an end token), enough to walk a grammar's parse."""

    eos_token_id = 256
    bos_token_id = None
    tokens = (*(bytes([i]) for i in range(256)), b"</s>")
    special_token_ids = (256,)

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_BYTES: LLTokenizer | None = None


def probe(grammar: str) -> None:
    """GrammarError if `grammar` fails within its first PROBE_STEPS bytes, each the lowest byte it allows,
    with at most PROBED_ROW_ITEMS Earley items a step: a grammar whose parse is too wide from its start
    (thousands of rules predicted at once) is refused here rather than failing once generation is under way."""
    global _BYTES
    if _BYTES is None:
        _BYTES = LLTokenizer(TokenizerWrapper(_Bytes()))
    matcher = LLMatcher(_BYTES, grammar, log_level=0, limits=LLParserLimits(max_items_in_row=PROBED_ROW_ITEMS))
    for _ in range(PROBE_STEPS):
        if matcher.is_error() or matcher.is_stopped():
            break
        mask = matcher.compute_bitmask()
        allowed = next((t for t in range(256) if mask[t // 8] >> (t % 8) & 1), None)
        if allowed is None or matcher.is_error():
            break
        matcher.consume_token(allowed)
    if matcher.is_error():
        reason = matcher.get_error().splitlines()[0].removeprefix("Parser Error: ")
        raise GrammarError(f"{reason} (at most {PROBED_ROW_ITEMS} items are accepted at admission)")
