"""worker/forward.py on the real default model (int8): a decode step and a prefill block in one pass give
each the logits and the cache entries of its own forward through transformers, bit for bit."""

from __future__ import annotations

import pytest
import torch

from common.settings import Settings
from worker.cache import new_cache
from worker.forward import Part, causal_mask, forward_parts
from worker.model import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(worker_threads=1))


def ids(loaded: LoadedModel, text: str, n: int) -> torch.Tensor:
    tokens = loaded.tokenizer(text * 20)["input_ids"][:n]
    assert len(tokens) == n
    return torch.tensor([tokens])


@torch.inference_mode()
def transformers_forward(loaded: LoadedModel, tokens: torch.Tensor, cache, depth: int,
                         last: torch.Tensor | None = None) -> torch.Tensor:
    rows, length = tokens.shape
    positions = torch.arange(depth, depth + length).expand(rows, length)
    mask = torch.ones(rows, depth + length, dtype=torch.long)
    keep = last[:, None] if last is not None else 1
    return loaded.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                        logits_to_keep=keep).logits[:, -1]


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
