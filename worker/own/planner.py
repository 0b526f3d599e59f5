"""Who prefills when, in the own engine: waiting sequences join prefill groups at the depth of their cached prefix
as slots allow, the groups take turns, and each step's kind and chunk size follow from what runs. Pure policy
over the waiting queue and the groups; worker/own/runner.py computes what it picks (docs/engine.md says why)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.settings import WorkerSettings
from worker.core import StepKind, cancel_waiting
from worker.own.sequences import PrefillGroup, Sequence
from worker.prefix import PrefixStore

DEFAULT_CHUNK = WorkerSettings.prefill_chunk
# Prompt tokens a prefill step may take while no sequence is running, and one forward of several blocks at most.
IDLE_PASS_TOKENS = 256
# Cached keys whose attention costs a prompt token about as much as the rest of its forward (the default model on
# 2 CPU cores: bench/chunked_prefill.py's mixed steps), and the fewest tokens a chunk takes in a decode step.
ATTENTION_KEYS_PER_TOKEN = 1024
MIN_CHUNK_TOKENS = 4


def chunk_tokens(chunk: int, depth: int) -> int:
    """Tokens of a prompt's next chunk in a decode step, `depth` tokens into it: `chunk` at its start, fewer
    deeper in, where each token also attends over every key before it, so that a chunk adds about the same time
    to the running streams' step at any depth."""
    deep = chunk * ATTENTION_KEYS_PER_TOKEN // (ATTENTION_KEYS_PER_TOKEN + depth)
    return min(chunk, max(MIN_CHUNK_TOKENS, deep))


@dataclass(frozen=True)
class Shape:
    """What the model's kernels allow a step (worker/own/engine.py finds it out): `mixes`, a prefill chunk in the
    decode step's forward; `exact_blocks`, groups of several rows padded to whole blocks; `blocks_together`, a
    forward of several blocks computing each token as its block's own forward would."""

    mixes: bool
    exact_blocks: bool
    blocks_together: bool


@dataclass
class Plan:
    kind: StepKind
    looked_up: list[tuple[int, int]] = field(default_factory=list)  # (prompt, cached) tokens of each admitted


class Planner:
    def __init__(self, slots: int, block: int, chunk_blocks: int, shape: Shape,
                 store: PrefixStore | None, static: bool = False) -> None:
        """`chunk_blocks`: blocks of each prompt a prefill step computes (0: whole prompts); `static`: a batch is
        admitted when the last one has wholly finished (for comparison only)."""
        self.slots, self.block, self.chunk_blocks = slots, block, chunk_blocks
        self.shape, self.store, self.static = shape, store, static
        self.waiting: deque[Sequence] = deque()
        self.prefills: list[PrefillGroup] = []
        self.last_kind: StepKind = "decode"
        self.groups_formed = 0
        self.prefill_turns = 0

    @property
    def prefilling(self) -> list[Sequence]:
        return [s for group in list(self.prefills) for s in group.sequences]

    def schedule(self, running: int, background: bool = False) -> Plan:
        """A decode that carries a chunk of one group (`mixed`, where the kernels allow), a prefill step or a
        decode; where a chunk cannot ride in the decode step, a prefill step is always followed by a decode. So
        neither arrivals nor long prompts hold `running` sequences up for more than a chunk. While batch lines are
        among the running rows (`background`), an interactive prompt's chunk is a prefill step of its own, ahead of
        their decode: its first token does not wait for the lane's rows (issue 46)."""
        mixing = self.shape.mixes and running > 0
        looked_up: list[tuple[int, int]] = []
        if mixing or not running or self.last_kind != "prefill":
            looked_up = self._admit(running)
            if self.prefills:
                ahead = background and self.last_kind != "prefill" and any(g.interactive for g in self.prefills)
                self.last_kind = "mixed" if mixing and not ahead else "prefill"
                return Plan(self.last_kind, looked_up)
        self.last_kind = "decode"
        return Plan("decode" if running else "idle", looked_up)

    def _admit(self, running: int) -> list[tuple[int, int]]:
        """Move waiting sequences, as slots allow, into prefill groups at the depth of their cached prefix.
        One whose next block another prefill is computing waits for it, to take it from the cache then."""
        if self.static and (running or self.prefills):
            return []
        room = self.slots - running - len(self.prefilling)
        computing = {digest for group in self.prefills for s in group.sequences
                     for digest in s.digests[group.depth // self.block:]}
        held: list[Sequence] = []
        looked_up = []
        while self.waiting and room > 0:
            sequence = self.waiting.popleft()
            cacheable = min(len(sequence.digests), (len(sequence.prompt_ids) - 1) // self.block)
            cached = self.store.longest(sequence.digests[:cacheable]) if self.store is not None else 0
            if cached < cacheable and sequence.digests[cached] in computing:
                held.append(sequence)
                continue
            computing.update(sequence.digests[cached:])
            self._join_group(sequence, cached)
            if self.store is not None:
                looked_up.append((len(sequence.prompt_ids), cached * self.block))
            room -= 1
        self.waiting.extendleft(reversed(held))
        return looked_up

    def _join_group(self, sequence: Sequence, cached: int) -> None:
        depth = cached * self.block
        group = next((g for g in self.prefills if g.cache is None and g.depth == depth and self.shape.exact_blocks
                      and g.interactive != sequence.background), None)
        if group is None:
            group = PrefillGroup([], depth, self.groups_formed)
            self.groups_formed += 1
            self.prefills.append(group)
        group.sequences.append(sequence)
        if cached:
            group.restored.append(self.store.take(sequence.digests[:cached]))

    def next_group(self) -> PrefillGroup:
        """Interactive groups before the batch lane's; among them turns alternate: the group nearest its end (a
        short prompt need not wait behind a long one), then the oldest (so that none waits forever)."""
        self.prefill_turns += 1
        if self.prefill_turns % 2:
            return min(self.prefills, key=lambda g: (not g.interactive, g.remaining(self.block), g.order))
        return min(self.prefills, key=lambda g: (not g.interactive, g.order))

    def prefill_blocks(self, running: bool) -> int | None:
        """Blocks a prefill step computes of its group (None: every prompt to its end). With nothing running, no
        stream waits on the step: a longer one costs only the other prefills a pass."""
        if not self.chunk_blocks:
            return None
        return self.chunk_blocks if running else max(self.chunk_blocks, IDLE_PASS_TOKENS // self.block)

    def mixed_tokens(self, group: PrefillGroup) -> int:
        """Tokens of `group`'s chunk in a decode step: one block where a forward's shape may change its bits;
        else chunk_tokens' share, up to the group's end and IDLE_PASS_TOKENS over its rows. (Whatever their
        number, each token's keys and values are those its block's own forward computes, so a prompt's blocks
        in the prefix cache stay the same.)"""
        if not self.shape.blocks_together:
            return self.block
        most = chunk_tokens(self.chunk_blocks * self.block, group.depth)
        return max(MIN_CHUNK_TOKENS, min(most, group.longest_left(), IDLE_PASS_TOKENS // len(group.sequences)))

    def blocks_after_mixed(self) -> int:
        """Blocks of the chunk still to compute after a mixed step's, a block a forward (none where the mixed
        step took the whole chunk)."""
        return 0 if self.shape.blocks_together else self.chunk_blocks - 1

    def pass_blocks(self, group: PrefillGroup, most: int | None) -> int:
        """Blocks of `group` one forward takes: up to `most` (None: IDLE_PASS_TOKENS' worth) and the group's end
        where the layers compute a run of blocks as each block's own forward would, else one. At most
        IDLE_PASS_TOKENS over all its rows: the attention's working memory grows with rows times tokens."""
        if not self.shape.blocks_together:
            return 1
        most = IDLE_PASS_TOKENS // self.block if most is None else most
        fits = IDLE_PASS_TOKENS // (self.block * len(group.sequences))
        return max(1, min(most, group.remaining(self.block), fits))

    def cancel(self, request_id: str) -> bool:
        if cancel_waiting(self.waiting, request_id):
            return True
        for group in self.prefills:
            rows = [i for i, s in enumerate(group.sequences) if s.request_id != request_id]
            if len(rows) < len(group.sequences):
                if rows:
                    group.select(rows)
                else:
                    self.prefills.remove(group)
                return True
        return False

    def clear(self) -> list[Sequence]:
        dropped = [*self.waiting, *self.prefilling]
        self.waiting.clear()
        self.prefills = []
        return dropped
