"""Keys of a request's leading text, for cache-aware routing: the scheduler cannot tokenise, so it and the
workers name a prompt's prefixes by hashes of its text, both computed here.

- chat: one key per leading run of messages before the last (the system prompt, then the system prompt and
  the first turn, ...): what a conversation's next request shares with its earlier ones;
- completions: one key per leading run of whole TEXT_BLOCK-character blocks, or of whole ID_BLOCK-id blocks
  for a prompt given as token ids (those keys meet only prompts given as the same ids).

Each key is chained onto the one before it, so equal keys mean equal text up to that point. A worker reports
the keys whose tokens it holds in its prefix cache; the scheduler sends a request to a worker holding its
deepest key. A collision only costs a cache miss: the worker's cache is keyed by the tokens themselves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import accumulate

from common.protocol import Submit

TEXT_BLOCK = 256  # characters per completion key: about one prefill block of tokens
ID_BLOCK = 64  # token ids per key of a prompt given as ids: about as many tokens as TEXT_BLOCK characters hold
MAX_KEYS = 64  # keys per request, from its start: bounds the scheduler's work and the worker's report
_KEY_BITS = 63  # a signed 64-bit integer on the bus for any msgpack reader


@dataclass(frozen=True)
class TextPrefix:
    """A key, and the share of the request's text (characters) it covers: the worker estimates from it how
    many of the prompt's tokens the key stands for."""

    key: int
    share: float


def prefix_keys(submit: Submit) -> list[TextPrefix]:
    if submit.messages is not None:
        messages = submit.messages
        total = sum(len(m.role) + len(m.content) + 2 for m in messages)
        return _chained(b"chat", [_text(f"{m.role}\n{m.content}\n") for m in messages[:-1][:MAX_KEYS]], total)
    if submit.prompt_token_ids is not None:
        ids = submit.prompt_token_ids
        blocks = min(len(ids) // ID_BLOCK, MAX_KEYS)
        # As decimal text: an id the gateway could not check against a vocabulary may have any size.
        return _chained(b"ids", [(" ".join(map(str, ids[b * ID_BLOCK:(b + 1) * ID_BLOCK])).encode(), ID_BLOCK)
                                 for b in range(blocks)], len(ids))
    text = submit.prompt or ""
    blocks = min(len(text) // TEXT_BLOCK, MAX_KEYS)
    return _chained(b"text", [_text(text[i * TEXT_BLOCK:(i + 1) * TEXT_BLOCK]) for i in range(blocks)], len(text))


def _text(part: str) -> tuple[bytes, int]:
    return part.encode("utf-8", "surrogatepass"), len(part)


def _chained(kind: bytes, parts: list[tuple[bytes, int]], total: int) -> list[TextPrefix]:
    """Keys of `parts` (each its bytes and its length in the request's units: characters or ids)."""
    keys, digest = [], kind
    for (part, _), end in zip(parts, accumulate(length for _, length in parts), strict=True):
        # Each part's length goes in too, so that no two splits of the same characters share a key.
        digest = hashlib.blake2b(digest + len(part).to_bytes(8, "big") + part, digest_size=8).digest()
        keys.append(TextPrefix(int.from_bytes(digest, "big") >> (64 - _KEY_BITS), end / max(total, 1)))
    return keys
