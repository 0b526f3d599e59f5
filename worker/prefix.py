"""The worker's prefix cache: the keys and values of prompt blocks, found again by the tokens up to their end.

The engine prefills every prompt in blocks of `block` tokens at fixed boundaries from its first token, so a
block's keys and values depend only on the tokens up to its end: they are stored under a digest of those tokens
(chained onto its parent's), and a later prompt with the same start takes its leading blocks from here and
computes the rest exactly as it would have: a hit changes no bit of the output (docs/engine.md). Nothing here
needs torch: a block is any value with `nbytes`, and the store is bounded by their sum.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from common.prefix_keys import TextPrefix

# PREFIX_CACHE_BYTES=auto: this share of the memory left once the model has loaded (workers that share a host start
# alike, each seeing the same memory), and at least the floor.
AUTO_SHARE = 8
AUTO_FLOOR = 64 << 20


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


B = TypeVar("B", bound=Sized)


def available_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process may still take: the host's MemAvailable, or its memory cgroup's limit less its usage (a
    container's memory limit, cgroup v2 or v1) where that is lower."""
    meminfo = dict(line.split(":", 1) for line in (proc / "meminfo").read_text().splitlines() if ":" in line)
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    for limit_file, usage_file in _memory_groups(proc, cgroups):
        try:
            limit, used = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit != "max":  # v2's word for none; v1 writes a number beyond any memory
            available = min(available, max(0, int(limit) - used))
    return available


def _memory_groups(proc: Path, cgroups: Path) -> list[tuple[Path, Path]]:
    """The limit and usage files of this process's own memory cgroup, as /proc/self/cgroup names it."""
    found = []
    for line in (proc / "self/cgroup").read_text().splitlines():
        number, controllers, group = line.split(":", 2)
        group = group.strip().lstrip("/")
        if number == "0" and not controllers:
            found.append((cgroups / group / "memory.max", cgroups / group / "memory.current"))
        elif "memory" in controllers.split(","):
            folder = cgroups / "memory" / group
            found.append((folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes"))
    return found


def cache_bytes(setting: int | None, available: int | None = None) -> int:
    """The prefix cache's bound: PREFIX_CACHE_BYTES's number, or for `auto` (None) a share of the memory left."""
    if setting is not None:
        return setting
    return max(AUTO_FLOOR, (available_bytes() if available is None else available) // AUTO_SHARE)


def block_digests(tokens: Sequence[int], block: int) -> list[bytes]:
    """One digest per whole block of `tokens`, each covering every token up to the block's end."""
    digests, digest = [], b""
    for start in range(0, len(tokens) - block + 1, block):
        digest = hashlib.blake2b(digest + array("q", tokens[start:start + block]).tobytes(), digest_size=16).digest()
        digests.append(digest)
    return digests


class PrefixStore(Generic[B]):
    """Blocks by digest, bounded by `capacity` bytes; the least recently used block goes first. A prompt's
    blocks are touched last-first, so a parent is always fresher than its children and eviction takes
    chains from their tails: a block is never kept while the blocks needed to reach it are gone.
    The heartbeat thread asks what is held while the engine's loop changes it: hence the lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, B] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def __contains__(self, digest: bytes) -> bool:
        with self.lock:
            return digest in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def longest(self, digests: Sequence[bytes]) -> int:
        """How many of `digests`, from the first, are held."""
        with self.lock:
            return next((i for i, digest in enumerate(digests) if digest not in self.blocks), len(digests))

    def take(self, digests: Sequence[bytes]) -> list[B]:
        """The blocks of `digests` (all held), marked used."""
        with self.lock:
            self._touch(digests)
            return [self.blocks[digest] for digest in digests]

    def put(self, digest: bytes, value: B, parents: Sequence[bytes] = ()) -> None:
        """Store a block (`parents`: the digests of the blocks before it), then evict the least recently used
        blocks until the rest fits."""
        if value.nbytes > self.capacity:
            return
        with self.lock:
            if digest not in self.blocks:
                self.blocks[digest] = value
                self.bytes += value.nbytes
            self._touch([*parents, digest])
            while self.bytes > self.capacity:
                _, old = self.blocks.popitem(last=False)
                self.bytes -= old.nbytes

    def _touch(self, digests: Sequence[bytes]) -> None:
        for digest in reversed(digests):
            if digest in self.blocks:
                self.blocks.move_to_end(digest)


class HeldPrefixes:
    """Which text keys (common/prefix_keys.py) the worker's cache can serve, for its heartbeat. A key maps to the
    digest of the last block its text covers (estimated from the key's share of the text, one block short to
    be safe); it is held while that block is stored. Bounded: the oldest keys are forgotten first. Another
    engine's cache (worker/vllm/engine.py) overrides how blocks are named and looked up."""

    def __init__(self, store: PrefixStore | None, block: int, limit: int = 4096) -> None:
        self.store = store
        self.block = block
        self.limit = limit
        self.keys: OrderedDict[int, bytes] = OrderedDict()
        self.lock = threading.Lock()

    def digests(self, prompt_ids: Sequence[int]) -> list[bytes]:
        """The names of the prompt's whole blocks, in order."""
        return block_digests(prompt_ids, self.block)

    def stored(self, digest: bytes) -> bool:
        return digest in self.store

    def remember(self, prefixes: list[TextPrefix], prompt_ids: Sequence[int]) -> None:
        digests = self.digests(prompt_ids)
        with self.lock:
            for prefix in prefixes:
                last = int(prefix.share * len(prompt_ids)) // self.block - 2
                if 0 <= last < len(digests):
                    self.keys[prefix.key] = digests[last]
                    self.keys.move_to_end(prefix.key)
            while len(self.keys) > self.limit:
                self.keys.popitem(last=False)

    def held(self, most: int = 512) -> list[int]:
        """Up to `most` keys whose blocks are stored, the most recently admitted first."""
        with self.lock:
            entries = list(reversed(self.keys.items()))
        return [key for key, digest in entries if self.stored(digest)][:most]
