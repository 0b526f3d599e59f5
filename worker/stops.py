"""Stop strings over streamed text.

Text reaches the client token by token, so a stop string may arrive in pieces.
The matcher holds back the longest tail of the unsent text that could still
grow into a stop string; that tail is sent once it can no longer match, or
dropped with everything after it once a stop string completes.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        # An empty stop string would match before any text; it stands for no stop at all.
        self.stops = tuple(stop for stop in stops if stop)
        self.held = ""

    def push(self, text: str, last: bool) -> tuple[str, bool]:
        """Take the next piece of completion text; return the text that may be sent now and whether a stop
        string completed (the returned text then ends right before it). On the last piece nothing is held."""
        text = self.held + text
        # The held tail is the only unsent text, and a stop string's start is always held, so looking in
        # `text` finds the first occurrence in the whole completion.
        cut = min((at for at in (text.find(stop) for stop in self.stops) if at >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return text[:cut], True
        held = 0 if last else self._partial_length(text)
        self.held = text[len(text) - held:]
        return text[:len(text) - held], False

    def _partial_length(self, text: str) -> int:
        """The length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
