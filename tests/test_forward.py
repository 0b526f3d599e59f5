"""worker/own/forward.py on the real default model as a worker loads it (the GGUF file's blocks where the compiled
kernels build, else int8): a decode step and a prefill block in one pass give each the logits and the cache
entries of its own forward through transformers, bit for bit; so do several blocks in one forward."""

from __future__ import annotations

import dataclasses

import torch

from tests.conftest import native_kernels
from worker.own.cache import new_cache
from worker.own.forward import Part, causal_mask, forward_parts
from worker.own.model import LoadedModel, pick_rows
from worker.weights.quant import takes_blocks_together


def ids(loaded: LoadedModel, text: str, n: int) -> torch.Tensor:
    tokens = loaded.tokenizer(text * (n // 4))["input_ids"][:n]
    assert len(tokens) == n
    return torch.tensor([tokens])


@torch.inference_mode()
def transformers_forward(loaded: LoadedModel, tokens: torch.Tensor, cache, depth: int,
                         last: torch.Tensor | None = None) -> torch.Tensor:
    rows, length = tokens.shape
    positions = torch.arange(depth, depth + length).expand(rows, length)
    mask = torch.ones(rows, depth + length, dtype=torch.long)
    return loaded.logits(tokens, mask, positions, cache, last)


def caches(loaded: LoadedModel) -> tuple:
    """A running batch of two rows at 24 tokens and a prefill row at depth 16, made the same way twice."""
    config = loaded.model.config
    running = torch.cat([ids(loaded, "The sea is calm tonight. ", 24), ids(loaded, "Bread and cakes daily. ", 24)])
    made = []
    for _ in range(2):
        batch, group = new_cache(config, ragged=True), new_cache(config, ragged=True)
        transformers_forward(loaded, running, batch, 0)
        transformers_forward(loaded, ids(loaded, "A long prompt arrives here. ", 16), group, 0)
        made.append((batch, group))
    return made


def test_a_decode_step_and_a_block_in_one_pass_are_each_their_own_forward(loaded: LoadedModel) -> None:
    (batch_a, group_a), (batch_b, group_b) = caches(loaded)
    step = torch.tensor([[11], [22]])
    block = ids(loaded, "A long prompt arrives here. ", 32)[:, 16:]
    last = torch.tensor([9])  # the row's prompt ends inside the block: the padding after it must not count
    alone = (transformers_forward(loaded, step, batch_a, 24), transformers_forward(loaded, block, group_a, 16, last))
    with torch.inference_mode():
        together = forward_parts(loaded.model, [
            Part(step, torch.full((2, 1), 24), batch_b),
            Part(block, torch.arange(16, 32).expand(1, 16), group_b, depth=16, last=last)])
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs)
    for a, b in ((batch_a, batch_b), (group_a, group_b)):
        for layer_a, layer_b in zip(a.layers, b.layers, strict=True):
            assert layer_a.rows.lengths == layer_b.rows.lengths
            for row in range(len(layer_a.rows.lengths)):
                assert all(torch.equal(x, y) for x, y in zip(layer_a.row(row), layer_b.row(row), strict=True))


def test_a_block_after_cached_tokens_sees_them_and_the_tokens_before_it_only() -> None:
    part = Part(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), None, depth=2)
    mask = causal_mask(part)
    assert mask.shape == (2, 1, 3, 5)
    assert mask[1, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                                   [True, True, True, True, True]]
    assert causal_mask(Part(part.ids, part.positions, None)) is None  # a first block: plainly causal
    assert causal_mask(Part(part.ids[:, :1], part.positions[:, :1], None, depth=7)) is None  # a decode step


def test_blocks_in_one_forward_are_each_block_s_own_forward_bit_for_bit(loaded: LoadedModel) -> None:
    """A prefill step may take several blocks of a group in one forward (worker/own/engine.py): every number of a
    token, its logits and its keys and values, is the one its own block's forward gives, whether the blocks
    start after cached tokens or not, and past 256 keys (the attention's runs)."""
    native_kernels()  # skipped only without a C++ compiler and ninja; a build error fails here
    assert takes_blocks_together(loaded.model), "the kernels built, but the model's layers are not all compiled"
    tokens = torch.cat([ids(loaded, "The sea is calm tonight. ", 304), ids(loaded, "Bread and cakes daily. ", 304)])

    @torch.inference_mode()
    def prefill(spans: list[tuple[int, int]], last: torch.Tensor | None = None) -> tuple[list[torch.Tensor], object]:
        cache, logits = new_cache(loaded.model.config, ragged=True, capacity=400), []
        for start, stop in spans:
            part = Part(tokens[:, start:stop], torch.arange(start, stop).expand(2, stop - start), cache, depth=start,
                        last=last if stop == 304 else None)
            logits += forward_parts(loaded.model, [part])
        return logits, cache

    blocks = [(start, start + 16) for start in range(0, 304, 16)]
    one_by_one, cache_a = prefill(blocks)
    # 3 blocks; 1; 12 alone; 3, where row 0 wants the logits of the first block's last token (its prompt's end)
    together, cache_b = prefill([(0, 48), (48, 64), *blocks[4:16], (256, 304)], last=torch.tensor([15, 47]))
    assert torch.equal(together[0], one_by_one[2])  # token 47, both rows
    assert torch.equal(together[-1][0], one_by_one[-3][0])  # token 271
    assert torch.equal(together[-1][1], one_by_one[-1][1])  # token 303
    for layer_a, layer_b in zip(cache_a.layers, cache_b.layers, strict=True):
        assert layer_a.rows.lengths == layer_b.rows.lengths == [304, 304]
        for row in range(2):
            assert all(torch.equal(x, y) for x, y in zip(layer_a.row(row), layer_b.row(row), strict=True))


def test_each_row_gets_its_own_position_from_the_last_kept_ones() -> None:
    logits = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # 2 rows, the last 3 of 8 positions kept, 4 logits each
    assert torch.equal(pick_rows(logits, 8, torch.tensor([7, 5])), torch.stack([logits[0, 2], logits[1, 0]]))
    assert torch.equal(pick_rows(logits, 8, None), logits[:, -1])


def test_transformers_before_5_24_gives_the_same_logits(loaded: LoadedModel) -> None:
    """Before 5.24 transformers takes the cache as `past_key_values` and keeps the same positions in every row;
    the worker extra allows those versions (vLLM's pins hold one), so LoadedModel.logits calls that way there.
    Forced to (newer ones still take the old name), rows ending at different tokens get the same logits."""
    older = dataclasses.replace(loaded)
    older.__dict__["_current_forward"] = False
    assert loaded._current_forward  # the venv's transformers: the other call is the one forced
    block = torch.cat([ids(loaded, "A long prompt arrives here. ", 16), ids(loaded, "Bread and cakes daily. ", 16)])
    last = torch.tensor([9, 15])
    config = loaded.model.config
    current = transformers_forward(loaded, block, new_cache(config, ragged=True), 0, last)
    before = transformers_forward(older, block, new_cache(config, ragged=True), 0, last)
    assert current.shape == before.shape == (2, loaded.vocab) and torch.equal(current, before)
