"""Jobs for tests/test_sandbox.py, run inside the sandbox's child (imported there by name)."""

from __future__ import annotations

import ctypes
import os
import time

from llguidance import LLMatcher


def act(what: str, value: object = None) -> object:
    if what == "echo":
        return value
    if what == "raise":
        raise ValueError(f"refused {value}")
    if what == "sleep":
        time.sleep(float(value))  # type: ignore[arg-type]
        return "slept"
    if what == "segfault":
        return ctypes.string_at(0)
    if what == "overflow":  # native recursion: compiling a chain of rules each referring to the next
        depth = int(value)  # type: ignore[arg-type]
        rules = [f'r{i}: r{i + 1} "t{i}" | "u{i}"' for i in range(depth)]
        lark = "\n".join(["start: r0", *rules, f'r{depth}: "x"'])
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))
    if what == "allocate":
        return len(bytearray(int(value)))  # type: ignore[arg-type]
    if what == "exit":
        raise SystemExit(3)
    if what == "die":
        os._exit(3)
    raise AssertionError(what)
