"""Where a stream's client stands in each of its choices (`Positions`: what is new to it, its events' ids, what it
has used of its key's quota), and the latency and token metrics observed as its results are taken (`Meter`)."""

from __future__ import annotations

import time

from common.protocol import Done, Error, Result, Token
from gateway import metrics
from gateway.sse import format_id
from gateway.throughput import SharedThroughput


class Positions:
    """For each choice, the position the client needs next (a token's index, or where the choice's end falls: one
    past its last token). A result before that position has been delivered already and is dropped; so is anything
    after a choice's end. `positions` (a resume's Last-Event-ID) is where the client stands: -1 before anything."""

    def __init__(self, choices: int, positions: list[int] | None = None) -> None:
        self.next = [p + 1 for p in positions] if positions else [0] * choices
        self.tokens = [0] * choices  # tokens seen of each choice, delivered or not: where its end falls
        self.ended = [False] * choices
        self.delivered_end = [False] * choices
        self.dones: dict[int, Done] = {}
        self.errors: dict[int, Error] = {}
        self.stale_error = False  # a choice ended in an error the client had already (a resume)

    @property
    def all_ended(self) -> bool:
        return all(self.ended)

    def accept(self, choice: int, result: Result) -> bool:
        """Whether `result` is new to the client; moves its position either way."""
        if choice >= len(self.ended) or self.ended[choice]:
            return False
        if isinstance(result, Token):
            self.tokens[choice] = max(self.tokens[choice], result.index + 1)
            if result.index < self.next[choice]:
                return False  # delivered before this stream began, or repeated after a migration
            self.next[choice] = result.index + 1
            return True
        self.ended[choice] = True
        position = max(self.tokens[choice], result.completion_tokens if isinstance(result, Done) else 0)
        fresh = position >= self.next[choice]
        if fresh:
            self.next[choice] = position + 1
        self.delivered_end[choice] = fresh
        if isinstance(result, Done):
            self.dones[choice] = result
        else:
            self.errors[choice] = result
            self.stale_error = self.stale_error or not fresh
        return fresh

    def event_id(self) -> str:
        """The id of the event of the result last taken: where the client stands once it has that event."""
        if len(self.next) == 1:
            return str(self.next[0] - 1)
        return format_id([position - 1 for position in self.next])

    def is_first(self, choice: int, result: Result) -> bool:
        """Whether `result` is the first thing the client gets of its choice."""
        position = result.index if isinstance(result, Token) else self.next[choice] - 1
        return position == 0

    def used(self) -> list[tuple[int, int]]:
        """Each choice's tokens as its key's quota counts them, from what this stream saw: (its tokens, its prompt's
        once its Done is seen). Every reader of the stream reports these; SPEND counts each only once."""
        return [(max(seen, done.completion_tokens), done.prompt_tokens) if (done := self.dones.get(choice))
                else (seen, 0) for choice, seen in enumerate(self.tokens)]


class Meter:
    """A stream's metrics as its results are taken: every token delivered counts out, and, for a client that read
    it from its start (not a resume, not a batch job's line), its latencies and its prompt."""

    def __init__(self, throughput: SharedThroughput, choices: int, timed: bool) -> None:
        self.throughput, self.timed = throughput, timed
        self.started = time.monotonic()
        self.last_at = [self.started] * choices

    def taken(self, choice: int, result: Result) -> None:
        if isinstance(result, Token):
            clock = time.monotonic()
            if self.timed:
                (metrics.ITL if result.index else metrics.TTFT).observe(clock - self.last_at[choice])
            self.last_at[choice] = clock
            metrics.TOKENS_OUT.inc()
            self.throughput.add(1)
            return
        if not self.timed:
            return
        metrics.E2E.observe(time.monotonic() - self.started)
        if isinstance(result, Done):
            metrics.TOKENS_IN.inc(result.prompt_tokens)
            metrics.QUEUE.observe(result.queue_s)
