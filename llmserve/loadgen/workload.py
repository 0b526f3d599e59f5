"""What a benchmark sends: prompts and output lengths drawn from a seeded distribution, and arrival times."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common one-token English words: a prompt of n words is close to n tokens for most tokenizers.
WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his",
    "her", "they", "this", "had", "not", "are", "but", "one", "all", "were", "when", "we", "there", "can", "an",
    "your", "which", "their", "said", "if", "will", "each", "about", "how", "up", "out", "them", "then", "she",
    "many", "some", "so", "these", "would", "other", "into", "has", "more", "two", "time", "like", "could", "see",
    "no", "way", "people", "my", "than", "first", "water", "been", "call", "who", "its", "now", "find", "long",
    "down", "day", "did", "get", "come", "made", "may", "part", "over", "new", "sound", "take", "only", "little",
    "work", "know", "place", "year", "live", "me", "back", "give", "most", "very", "after", "thing", "our", "just",
    "name", "good", "man", "think", "say", "great", "where", "help", "through", "much", "before", "line", "right",
    "too", "mean", "old", "any", "same", "tell", "boy", "follow", "came", "want", "show", "also", "around", "form",
    "three", "small", "set", "put", "end", "does", "another", "well", "large", "must", "big", "even", "such",
    "because", "turn", "here", "why", "ask", "went", "men", "read", "need", "land", "different", "home", "us",
    "move", "try", "kind", "hand", "picture", "again", "change", "off", "play", "spell",
)


@dataclass(frozen=True)
class Lengths:
    """A token count: `64`, `uniform:16:256` or `normal:128:32` (clipped to at least 1)."""

    kind: str
    low: float
    high: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, _, rest = text.partition(":")
        try:
            if not rest:
                return cls("fixed", int(kind))
            low, high = (float(part) for part in rest.split(":"))
        except ValueError:
            raise ValueError(f"{text!r}: expected N, uniform:LOW:HIGH or normal:MEAN:SD") from None
        if kind not in ("uniform", "normal"):
            raise ValueError(f"{text!r}: unknown distribution {kind!r} (uniform or normal)")
        return cls(kind, low, high)

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            value = rng.randint(int(self.low), int(self.high))
        elif self.kind == "normal":
            value = round(rng.gauss(self.low, self.high))
        else:
            value = int(self.low)
        return max(1, value)

    def __str__(self) -> str:
        return str(int(self.low)) if self.kind == "fixed" else f"{self.kind}:{self.low:g}:{self.high:g}"


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    # Text every request of the workload starts with (a chat's system message), or none.
    shared: str = ""


def make_jobs(count: int, prompt_lengths: Lengths, output_lengths: Lengths, seed: int,
              shared_tokens: int = 0) -> list[Job]:
    """Distinct prompts (a numbered opening), so no server can answer one from another's cache; with
    `shared_tokens`, each after one shared text of about that many tokens (a shared-prefix workload:
    a long system prompt and short distinct questions), which a prefix cache may reuse."""
    rng = random.Random(seed)
    shared = shared_text(shared_tokens, seed) if shared_tokens else ""
    jobs = []
    for number in range(count):
        words = [rng.choice(WORDS) for _ in range(max(0, prompt_lengths.draw(rng) - 2))]
        jobs.append(Job(f"{number}. " + " ".join(words), output_lengths.draw(rng), shared))
    return jobs


def shared_text(tokens: int, seed: int) -> str:
    """About `tokens` tokens of seeded common words (one word is about one token)."""
    rng = random.Random(seed + 7)
    return "Instructions: " + " ".join(rng.choice(WORDS) for _ in range(max(0, tokens - 3))) + "."


def arrival_offsets(count: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate` per second,
    or all at once when there is no rate (closed loop, limited by concurrency)."""
    if not rate:
        return [0.0] * count
    rng = random.Random(seed + 1)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets
