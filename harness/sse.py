"""The one SSE parser of the tests and benchmarks: a stream's lines, however they were read (httpx's iter_lines or
aiter_lines), as events of (event, id, data) as a client sees them. tests/sse.py builds the tests' stream readers
on it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field

DONE = "[DONE]"  # the OpenAI stream's last data


@dataclass
class Event:
    event: str | None
    id: str | None
    data: dict  # the JSON data; {} for the OpenAI stream's [DONE]
    retry: int | None = None
    raw: str = ""  # the data as sent

    @property
    def done(self) -> bool:
        return self.raw == DONE


@dataclass
class _Assembler:
    """The fields of the event being read; a blank line ends it."""

    event: str | None = None
    id: str | None = None
    data: list[str] = field(default_factory=list)
    retry: int | None = None

    def feed(self, line: str) -> Event | None:
        """The event `line` ends, if it ends one with data; a comment (`:`) or an unknown field is ignored."""
        if not line:
            ended = None
            if self.data:
                raw = "\n".join(self.data)
                ended = Event(self.event, self.id, {} if raw == DONE else json.loads(raw), self.retry, raw)
            self.event, self.id, self.data, self.retry = None, None, [], None
            return ended
        if line.startswith("data:"):
            self.data.append(line[5:].strip())
        elif line.startswith("id:"):
            self.id = line[3:].strip()
        elif line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("retry:"):
            self.retry = int(line[6:].strip())
        return None


def parse(lines: Iterable[str]) -> Iterator[Event]:
    """The events of an SSE body's lines."""
    assembler = _Assembler()
    for line in lines:
        if (event := assembler.feed(line)) is not None:
            yield event


async def aparse(lines: AsyncIterable[str]) -> AsyncIterator[Event]:
    """The same of lines read asynchronously (httpx's `aiter_lines()`)."""
    assembler = _Assembler()
    async for line in lines:
        if (event := assembler.feed(line)) is not None:
            yield event
