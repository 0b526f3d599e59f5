"""Next-token choice for a whole batch: greedy rows by argmax, sampled rows with
temperature, top-k and top-p, each row drawing from its own seeded generator so
that its text does not depend on its batch-mates."""

from __future__ import annotations

import torch

from common.protocol import SamplingParams


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int]]) -> list[int]:
    """Pick one token per row of `logits` [batch, vocab]; `banned[i]` lists tokens row i may not pick."""
    logits = logits.float()
    for row, tokens in enumerate(banned):
        if tokens:
            logits[row, tokens] = float("-inf")
    chosen = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if p.temperature > 0]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        picked = _sample_rows(logits[rows], [params[r] for r in sampled_rows], [generators[r] for r in sampled_rows])
        chosen[rows] = picked
    return chosen.tolist()


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    sorted_logits, order = torch.sort(logits / temperature, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=device).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params], device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p, 0.0)
    picks = [torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(len(params))]
    return order.gather(1, torch.stack(picks)).squeeze(1)
