"""Who runs next, on which worker, in which message: the scheduler's policy as pure code.

- A request runs only on a worker that answers to the model it names (any worker, if it names none): each
  model's workers are a pool of their own, and a model without free slots holds up no other model.
- Interactive requests moved off a lost worker go first: their clients are already mid-stream.
- Among the rest, the tenant with the fewest requests running goes next (ties: the oldest
  request first), so a flood from one tenant does not delay another's first token, and
  one tenant never holds every slot: a few stay free for a newcomer. A lower `priority` (vLLM's
  meaning) goes first within a tenant, and between tenants that run as many: it never buys more
  than a tenant's fair share (without API keys every request is its own tenant, running none).
- Each request goes to the worker with the most free slots, unless a worker that caches the
  request's prefix (by the text keys of common/prefix_keys.py) has room and at least half as many
  free slots: a cache hit is worth a little imbalance, never a wait while another worker has
  room. Each worker's share is cut into batches that fit one bus message.
- The lines of batch jobs (`Submit.background`) wait in a lane of their own, per model: one starts only while no
  interactive request of its model waits, and together they hold at most a tenant's share of the slots, so an
  interactive arrival always finds a slot free. Nor do they take the slots interactive requests held or waited
  for a moment ago (`InteractivePeak`): a client's next request, sent as its last one ends, finds that slot free.
  When interactive requests wait past the free slots, running lines hand theirs back (`lines_to_yield`, a Yield to
  their worker) and go back to the lane with their delivered tokens, ahead of the newer lines by their age; a moved
  line (a lost worker's too) never jumps ahead of interactive requests. After YIELD_LIMIT yields a line runs to
  its end.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from common.prefix_keys import prefix_keys
from common.protocol import ModelLoad, Submit

# Bytes of a Batch message around its sequences (tag, field names, batch id), with room to spare.
BATCH_OVERHEAD = 256
# A request's prefix counts as its worker's from dispatch on, for this many seconds, before the worker's
# heartbeat can say so itself (its prefill may take a while): the rest of a burst sharing it follows.
EXPECTED_TTL = 15.0
EXPECTED_LIMIT = 1024  # keys remembered that way per worker, the oldest forgotten first
# The tenant every background request runs as: the lane's slots are counted as one tenant's.
BACKGROUND = "~background"
# How long the lane leaves free the most slots interactive requests held or waited for: far longer than a client
# takes between one answer's end and its next request, short beside a batch job's run.
INTERACTIVE_MEMORY_S = 5.0
# Times one batch line may hand its slot back to interactive requests: past it, it runs to its end (it cannot
# bounce for ever under a steady surge, redoing its prefill each time).
YIELD_LIMIT = 3
# Heartbeat intervals the scheduler waits for a worker's Yielded before it may ask for those lines again.
YIELD_PATIENCE_BEATS = 2


# Classes of urgency the scheduler's metrics are labelled by (a label per priority value would be unbounded).
PRIORITY_CLASSES = ("urgent", "default", "low", "background")


def priority_class(submit: Submit) -> str:
    """A batch job's line, or a request's priority below, at or above the default 0."""
    if submit.background:
        return "background"
    return "urgent" if submit.priority < 0 else "low" if submit.priority > 0 else "default"


def runs_as(submit: Submit) -> str:
    """The tenant a request's slot counts for."""
    return BACKGROUND if submit.background else submit.tenant


@dataclass
class Queued:
    """A request waiting for a worker, with its stream entry and its encoded size."""

    submit: Submit
    entry_id: bytes
    size: int

    @property
    def request_id(self) -> str:
        return self.submit.request_id

    @property
    def tenant(self) -> str:
        return runs_as(self.submit)

    @property
    def model(self) -> str:
        return self.submit.model

    @cached_property
    def prefix_keys(self) -> tuple[int, ...]:
        return tuple(prefix.key for prefix in prefix_keys(self.submit))


@dataclass
class WorkerState:
    worker_id: str
    slots: int
    assigned: dict[str, str] = field(default_factory=dict)  # request_id -> tenant, until the worker frees it
    draining: bool = False
    prefixes: frozenset[int] = frozenset()  # text keys its heartbeat says its prefix cache holds
    expected: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> until: sent its way since
    models: frozenset[str] = frozenset()  # the names it answers to (none known: any)
    settled: set[str] = field(default_factory=set)  # its batch lines at YIELD_LIMIT: they run to their end

    @property
    def free(self) -> int:
        """Slots for new work: none while the worker drains before it stops."""
        return 0 if self.draining else self.slots - len(self.assigned)

    def serves(self, model: str) -> bool:
        return not model or not self.models or model in self.models

    def holds(self, keys: Sequence[int], clock: float) -> int:
        """How deep into `keys` (a request's, from its start) this worker caches: its deepest key held counts."""
        for depth in range(len(keys), 0, -1):
            if keys[depth - 1] in self.prefixes or self.expected.get(keys[depth - 1], 0.0) > clock:
                return depth
        return 0

    def expect(self, keys: Sequence[int], until: float) -> None:
        for key in keys:
            self.expected[key] = until
            self.expected.move_to_end(key)
        while len(self.expected) > EXPECTED_LIMIT:
            self.expected.popitem(last=False)


def fits_a_batch(size: int, limit: int) -> bool:
    """Whether a request of `size` encoded bytes can travel to a worker at all."""
    return size + BATCH_OVERHEAD <= limit


def tenant_cap(total_slots: int) -> int:
    """The most slots one tenant may hold: all but an eighth (at least one, on clusters of two or more)."""
    return max(1, total_slots - max(1, total_slots // 8))


# A tenant's waiting request as its heap orders it: lowest priority first, then the oldest (then the first added).
Ranked = tuple[int, float, int, Queued]


class WaitingQueue:
    """The requests no worker has taken yet: the migrated lane, then one queue per model and tenant, by priority
    and age, then the background lane (one queue per model). With `fair` off (SCHEDULING_POLICY=fifo) the
    interactive requests of one model share one queue and no tenant is capped."""

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self.migrated: deque[Queued] = deque()
        self.tenants: dict[tuple[str, str], list[Ranked]] = {}  # (model, tenant) -> a heap of its requests
        self.background: dict[str, list[Ranked]] = {}  # model -> a heap of its batch jobs' lines
        self._added = itertools.count()

    def __len__(self) -> int:
        return len(self.migrated) + sum(len(q) for q in [*self.tenants.values(), *self.background.values()])

    def __iter__(self) -> Iterator[Queued]:
        yield from self.migrated
        for queue in [*self.tenants.values(), *self.background.values()]:
            yield from (ranked[-1] for ranked in queue)

    def interactive(self) -> int:
        """Requests waiting that are not batch lines."""
        return sum(not item.submit.background for item in self.migrated) + sum(map(len, self.tenants.values()))

    def depths(self) -> Counter[str]:
        """Requests waiting, by the model they name."""
        return Counter(item.model for item in self)

    def add(self, item: Queued) -> None:
        # A batch line moved (its worker lost, or it yielded) goes back to the lane: its age puts it ahead of the
        # newer lines there, never ahead of an interactive request.
        if item.submit.migrations and not item.submit.background:
            self.migrated.append(item)
            return
        ranked = (item.submit.priority, item.submit.submitted_at, next(self._added), item)
        if item.submit.background:
            heapq.heappush(self.background.setdefault(item.model, []), ranked)
            return
        heapq.heappush(self.tenants.setdefault((item.model, item.tenant if self.fair else ""), []), ranked)

    def remove(self, request_id: str) -> Queued | None:
        for item in self:
            if item.request_id == request_id:
                self._drop([item])
                return item
        return None

    def expired(self, clock: float) -> list[Queued]:
        """Take out and return every request whose queue deadline has passed."""
        gone = [item for item in self if item.submit.deadline and item.submit.deadline < clock]
        self._drop(gone)
        return gone

    def pop_next(self, running: Counter[str], cap: int, placeable: Callable[[str], bool] = lambda _: True,
                 background: int = 0) -> Queued | None:
        """The next request to run, given how many each tenant runs, among those whose model has a worker with
        room (`placeable`); a background one (at most `background` more may start) only for a model no
        interactive request waits for. None if only capped tenants, or only models without room, wait."""
        for item in self.migrated:
            if placeable(item.model):
                self.migrated.remove(item)
                return item
        ready = [(running[tenant], q[0][:2], tenant, model)  # q[0][:2]: its first request's priority and age
                 for (model, tenant), q in self.tenants.items() if running[tenant] < cap and placeable(model)]
        if ready:
            _, _, tenant, model = min(ready)
            return self._pop(self.tenants, (model, tenant))
        if background <= 0:
            return None
        waiting = {model for model, _ in self.tenants}
        lanes = [(q[0][:2], model) for model, q in self.background.items()
                 if model not in waiting and placeable(model)]
        return self._pop(self.background, min(lanes)[1]) if lanes else None

    @staticmethod
    def _pop(heaps: dict[Any, list[Ranked]], key: object) -> Queued:
        queue = heaps[key]
        item = heapq.heappop(queue)[-1]
        if not queue:
            del heaps[key]
        return item

    def _drop(self, items: list[Queued]) -> None:
        ids = {item.request_id for item in items}
        if not ids:
            return
        self.migrated = deque(i for i in self.migrated if i.request_id not in ids)
        for heaps in (self.tenants, self.background):
            for key in list(heaps):
                left = [ranked for ranked in heaps[key] if ranked[-1].request_id not in ids]
                if left:
                    heapq.heapify(left)
                    heaps[key] = left
                else:
                    del heaps[key]


class InteractivePeak:
    """The most slots interactive requests held or waited for (`interactive_demand`) within the last `window`
    seconds: the batch lane leaves them free. A line that took the slot a stream had just left would make that
    client's next request wait for the line's end (issue 46)."""

    def __init__(self, window: float = INTERACTIVE_MEMORY_S) -> None:
        self.window = window
        self.marks: deque[tuple[float, int]] = deque()  # (clock, demand), the demands falling from the first on

    def note(self, clock: float, demand: int) -> int:
        """Add the demand now; return the peak of the window."""
        while self.marks and self.marks[-1][1] <= demand:
            self.marks.pop()
        self.marks.append((clock, demand))
        while self.marks[0][0] < clock - self.window:
            self.marks.popleft()
        return self.marks[0][1]


def interactive_demand(queue: WaitingQueue, workers: list[WorkerState]) -> int:
    """Slots interactive requests hold or wait for now."""
    return queue.interactive() + sum(t != BACKGROUND for w in workers for t in w.assigned.values())


def plan(queue: WaitingQueue, workers: list[WorkerState], limit: int,
         clock: float = 0.0, reserved: int = 0) -> list[tuple[str, list[Queued]]]:
    """Pop what the free slots take, as (worker_id, batch) pairs whose batches each fit `limit` bytes; batch
    lines leave `reserved` slots (an InteractivePeak) to interactive requests.

    Filling the emptiest worker first spreads a burst over all workers (each one is separate
    compute), while each worker still receives its share in as few messages as fit; a request
    whose prefix a worker with room caches goes there instead (`choose`). A request goes only to a
    worker that serves its model."""
    states = {w.worker_id: w for w in workers}
    free = {w.worker_id: w.free for w in workers if w.free > 0}
    assigned = Counter(tenant for w in workers for tenant in w.assigned.values())
    total = sum(w.slots for w in workers if not w.draining)
    background = min(tenant_cap(total), total - reserved) - assigned[BACKGROUND]
    running = assigned if queue.fair else Counter()
    cap = tenant_cap(total) if queue.fair else sum(free.values())
    batches: dict[str, list[list[Queued]]] = {}
    sizes: dict[str, int] = {}
    def placeable(model: str) -> bool:
        return any(states[w].serves(model) for w in free)

    while free and (item := queue.pop_next(running, cap, placeable, background)) is not None:
        background -= item.submit.background
        worker_id = choose(item.prefix_keys, {w: n for w, n in free.items() if states[w].serves(item.model)},
                           states, clock)
        states[worker_id].expect(item.prefix_keys, clock + EXPECTED_TTL)
        chunks = batches.setdefault(worker_id, [[]])
        if chunks[-1] and sizes[worker_id] + item.size > limit:
            chunks.append([])
        if not chunks[-1]:
            sizes[worker_id] = BATCH_OVERHEAD
        chunks[-1].append(item)
        sizes[worker_id] += item.size
        running[item.tenant if queue.fair else ""] += 1
        free[worker_id] -= 1
        if not free[worker_id]:
            del free[worker_id]
    return [(worker_id, chunk) for worker_id, chunks in batches.items() for chunk in chunks]


def lines_to_yield(queue: WaitingQueue, workers: list[WorkerState],
                   yielding: frozenset[str] | set[str] = frozenset()) -> dict[str, list[str]]:
    """Which running batch lines to hand back so that the interactive requests waiting now start at once: worker_id
    -> request_ids (`Yields.ask` remembers what it asked). Each worker ends those rows and says so (a Yielded
    event), and the scheduler puts the lines back in the background lane with their delivered tokens, as it
    moves a draining worker's requests.

    Per model, the interactive requests waiting that could run now (their tenant under its cap, at most the cap's
    room) beyond the free slots of the workers serving it, less the lines already asked to yield there
    (`yielding`), are taken from those workers' lines, the latest dispatched first (the least work to redo, since
    their cache is computed again), from the worker with the most lines left first. A draining worker's lines are
    left to its hand-off, and a line at YIELD_LIMIT (`settled`) to its end; a free slot counts once, for the first
    model that needs it."""
    live = [w for w in workers if not w.draining]
    total = sum(w.slots for w in live)
    assigned = Counter(tenant for w in workers for tenant in w.assigned.values())
    cap = tenant_cap(total) if queue.fair else total
    room = {tenant: max(0, cap - assigned[tenant]) for tenant in assigned}
    demand: Counter[str] = Counter(item.model for item in queue.migrated if not item.submit.background)
    for (model, tenant), waiting in sorted(queue.tenants.items(), key=lambda kv: kv[1][0][:2]):
        runnable = len(waiting) if not queue.fair else min(len(waiting), room.setdefault(tenant, cap))
        demand[model] += runnable
        if queue.fair:
            room[tenant] -= runnable
    free = {w.worker_id: w.free for w in live}
    lines = {w.worker_id: [rid for rid, tenant in reversed(w.assigned.items())
                           if tenant == BACKGROUND and rid not in yielding and rid not in w.settled] for w in live}
    coming = {w.worker_id: sum(rid in yielding for rid in w.assigned) for w in live}
    chosen: dict[str, list[str]] = {}
    for model, need in sorted(demand.items()):
        serving = [w.worker_id for w in live if w.serves(model)]
        for worker_id in serving:  # free slots first, then the slots already coming free
            for pool in (free, coming):
                taken = min(need, pool[worker_id])
                pool[worker_id] -= taken
                need -= taken
        while need > 0:
            worker_id = max(serving, key=lambda w: len(lines[w]), default=None)
            if worker_id is None or not lines[worker_id]:
                break
            chosen.setdefault(worker_id, []).append(lines[worker_id].pop(0))
            need -= 1
    return chosen


class Yields:
    """The lines the scheduler asked to yield, and when: each counts as a slot coming free until its worker's
    Yielded (or Finished) takes it off its worker, or until `patience` seconds pass without it (a worker that missed
    the ask, or a line that ended meanwhile), when it may be asked again."""

    def __init__(self, patience: float) -> None:
        self.patience = patience
        self.asked: dict[str, float] = {}  # request_id -> when its worker was asked
        self.cancelled: set[str] = set()  # asked, then cancelled: ended, not queued again, once handed back

    def ask(self, queue: WaitingQueue, workers: list[WorkerState], clock: float) -> dict[str, list[str]]:
        """The lines to ask now (`lines_to_yield`), remembered as asked."""
        running = {rid for w in workers for rid in w.assigned}
        self.asked = {rid: at for rid, at in self.asked.items() if rid in running and at > clock - self.patience}
        self.cancelled &= running
        if not queue.interactive():
            return {}
        chosen = lines_to_yield(queue, workers, set(self.asked))
        self.asked.update((rid, clock) for rids in chosen.values() for rid in rids)
        return chosen


def choose(keys: Sequence[int], free: dict[str, int], states: dict[str, WorkerState], clock: float) -> str:
    """The worker (among those with `free` slots) for a request with these prefix keys: the one caching the
    deepest of them if it has at least half the free slots of the emptiest worker, else the emptiest."""
    emptiest = max(free, key=free.__getitem__)
    if not keys:
        return emptiest
    depth, room, holder = max((states[w].holds(keys, clock), free[w], w) for w in free)
    return holder if depth and 2 * room >= free[emptiest] else emptiest


def model_figures(waiting: Counter[str], running: Counter[str],
                  worker_models: Sequence[frozenset[str]]) -> dict[str, ModelLoad]:
    """Each named model's waiting and running requests and live workers (requests naming no model left out)."""
    names = {m for m in [*waiting, *running] if m} | {m for models in worker_models for m in models if m}
    return {name: ModelLoad(waiting[name], running[name], sum(name in models for models in worker_models))
            for name in sorted(names)}
