"""Sampled rows: which tokens top-k and top-p leave, how often each is drawn, and that a row that cannot be
sampled leaves its batch-mates' generators untouched. No model: logits are made up."""

from __future__ import annotations

import pytest
import torch

from common.protocol import SamplingParams
from worker.sampling import NUCLEUS_CANDIDATES, _candidates, sample


def reference(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, over the whole sorted vocabulary in double precision: each token's probability of being
    drawn, and which tokens sit so close to the top_p boundary that float rounding may put them either side."""
    vocab = logits.shape[-1]
    k = min(params.top_k, vocab) if params.top_k > 0 else vocab
    values, order = torch.sort(logits.double(), descending=True)
    values[k:] = float("-inf")
    probs = values.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    outside = before >= params.top_p
    outside[0] = False
    edge = torch.zeros(vocab, dtype=torch.bool)
    edge[order] = (before - params.top_p).abs() < 1e-5
    probs[outside] = 0
    drawn = torch.zeros(vocab, dtype=torch.float64)
    drawn[order] = probs / probs.sum()
    return drawn, edge


def drawable(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What `_candidates` leaves, as each vocabulary token's probability of being drawn."""
    ids, weights = _candidates(logits, params)
    drawn = torch.zeros(logits.shape[-1], dtype=torch.float64)
    if ids is None:
        drawn += weights.double()
    else:
        drawn[ids] = weights.double()
    return drawn / drawn.sum()


CASES = [
    SamplingParams(top_k=50, top_p=0.95),  # /v1/completions' defaults
    SamplingParams(top_k=0, top_p=1.0),  # /v1/chat/completions' defaults: the whole vocabulary
    SamplingParams(top_k=0, top_p=0.9),
    SamplingParams(top_k=3, top_p=1.0),
    SamplingParams(top_k=5000, top_p=0.999),  # a top_k past the candidates
    SamplingParams(top_k=0, top_p=1e-300),  # only the most likely token
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("spread", [0.5, 4.0])
def test_the_candidates_are_the_definitions_tokens_and_probabilities(params: SamplingParams, spread: float) -> None:
    logits = torch.randn(20_000, generator=torch.Generator().manual_seed(2)) * spread
    ours, (wanted, edge) = drawable(logits, params), reference(logits, params)
    assert torch.equal((ours > 0)[~edge], (wanted > 0)[~edge])
    assert torch.allclose(ours[~edge], wanted[~edge], atol=1e-5)


def test_a_nucleus_past_the_first_candidates_is_found_in_the_rest_of_the_top_k() -> None:
    # Nearly flat: half of the mass takes thousands of tokens, more than a top-k of the candidates holds.
    logits = -torch.arange(8_000, dtype=torch.float32) * 1e-4
    params = SamplingParams(top_k=0, top_p=0.5)
    wanted, edge = reference(logits, params)
    assert int((wanted > 0).sum()) > NUCLEUS_CANDIDATES
    assert torch.equal((drawable(logits, params) > 0)[~edge], (wanted > 0)[~edge])


def test_draws_follow_the_probabilities_and_stay_inside_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.85)  # keeps the first four (0.8 before the fifth)
    generator = torch.Generator().manual_seed(11)
    draws = 20_000
    tokens, _ = sample(logits.expand(draws, -1), [params] * draws, [generator] * draws, [[]] * draws, [[]] * draws)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    assert counts[4:].sum() == 0
    expected = torch.tensor([0.4, 0.25, 0.15, 0.1]) / 0.9 * draws
    # Each count within five standard deviations of its binomial expectation.
    assert ((counts[:4] - expected).abs() < 5 * (expected * (1 - expected / draws)).sqrt()).all()


def test_the_whole_vocabulary_is_drawn_from_including_its_last_token() -> None:
    logits = torch.zeros(3)
    logits[2] = 1.0
    generator = torch.Generator().manual_seed(5)
    draws = 3_000
    tokens, _ = sample(logits.expand(draws, -1), [SamplingParams(temperature=1.0, top_k=0, top_p=1.0)] * draws,
                       [generator] * draws, [[]] * draws, [[]] * draws)
    counts = torch.bincount(torch.tensor(tokens), minlength=3)
    assert (counts > 0).all() and counts[2] > counts[0] and counts[2] > counts[1]


def test_a_row_that_cannot_be_sampled_raises_before_its_batch_mates_draw() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=0.9) for k in (0, 0, 20)]
    generators = [torch.Generator().manual_seed(seed) for seed in (1, 2, 3)]
    with pytest.raises(ValueError, match="not finite"):
        sample(logits, params, generators, [[]] * 3, [[]] * 3)
    # The good rows, sampled again (as the engine does then), draw what they would have drawn at first.
    again, _ = sample(logits[[0, 2]], [params[0], params[2]], [generators[0], generators[2]], [[], []], [[], []])
    fresh, _ = sample(logits[[0, 2]], [params[0], params[2]], [torch.Generator().manual_seed(s) for s in (1, 3)],
                      [[], []], [[], []])
    assert again == fresh


def test_a_row_draws_the_same_tokens_alone_and_among_batch_mates_of_every_kind() -> None:
    # Each row draws from its own generator over its own distribution, whatever its batch-mates ask for.
    logits = torch.randn(8, 5_000, generator=torch.Generator().manual_seed(3)) * 3
    kinds = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 50, 0.95), (0.0, 0, 1.0), (1.3, 0, 1.0), (0.5, 0, 0.5),
             (1.0, 5_000, 1.0), (2.0, 0, 1.0)]  # (temperature, top_k, top_p)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in kinds]

    def draw(rows: list[int], seeds: list[int]) -> list[int]:
        generators = [torch.Generator().manual_seed(seeds[row]) for row in rows]
        return sample(logits[rows], [params[row] for row in rows], generators, [[]] * len(rows), [[]] * len(rows))[0]

    whole = [row for row, p in enumerate(params) if p.top_k == 0 and p.top_p >= 1]  # the whole-vocabulary rows
    for turn in range(25):
        seeds = [100 * turn + row for row in range(len(params))]
        alone = [draw([row], seeds)[0] for row in range(len(params))]
        assert draw(list(range(len(params))), seeds) == alone
        assert draw(whole, seeds) == [alone[row] for row in whole]
