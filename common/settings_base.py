"""How a concern's settings are declared (`setting`: a default and a meaning), read from their environment
variables and checked (`Concern`); the concerns themselves are in common/settings.py and
common/settings_engine.py."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from common.errors import SettingsError


def setting(default: Any, doc: str, choices: tuple[str, ...] = (), positive: bool = False, shown: str = "") -> Any:
    """A field of a concern: its default, its meaning (markdown, for the README), the only values it takes (if a
    few), whether it must be above 0, and how the README shows its default (if not as it is)."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "positive": positive, "shown": shown})


@dataclass(frozen=True)
class Concern:
    """Settings of one concern; `title` heads its table in the README."""

    title: ClassVar[str] = ""

    @classmethod
    def from_env(cls) -> Any:
        """Each field is read from the upper-case environment variable of the same name; a value that
        does not parse, or is out of range, raises SettingsError naming the variable."""
        values = {}
        for declared in fields(cls):
            name = declared.name.upper()
            raw = os.environ.get(name)
            if raw is None:
                continue
            kind = type(declared.default)
            try:
                values[declared.name] = kind(raw)
            except ValueError:
                raise SettingsError(f"{name}={raw!r}: expected {kind.__name__}") from None
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Every field against its declaration, then each concern's own rules (`_rules`)."""
        for declared in fields(self):
            name, value, meta = declared.name.upper(), getattr(self, declared.name), declared.metadata
            if isinstance(value, int | float) and value < 0:
                raise SettingsError(f"{name}={value}: must not be negative")
            if meta["choices"] and value not in meta["choices"]:
                *others, last = meta["choices"]
                raise SettingsError(f"{name}={value!r}: expected {', '.join(others)} or {last}")
            if meta["positive"] and value <= 0:
                raise SettingsError(f"{name}={value}: must be positive")
        for concern in type(self).__mro__:
            if "_rules" in vars(concern):
                vars(concern)["_rules"](self)
