"""Next-token choice for a whole batch: presence and frequency penalties, then
greedy rows by argmax, sampled rows with temperature, top-k and top-p, each row
drawing from its own seeded generator so that its text does not depend on its
batch-mates. Rows that ask for them also get log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.protocol import SamplingParams

# The most alternatives a row may ask log-probabilities for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# Below this temperature sampling is greedy in all but name, and dividing by it would overflow.
GREEDY_BELOW = 1e-5
# A logit_bias this low (OpenAI's floor) bans the token outright rather than merely lowering it.
BAN_BIAS = 100.0


@dataclass
class Logprobs:
    """Log-probabilities under the model's own distribution: the chosen token's and the most likely ones'."""

    chosen: float
    top_ids: list[int]
    top_values: list[float]


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature < GREEDY_BELOW:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int]], generated: list[list[int]], grammar: list[torch.Tensor | None] | None = None
           ) -> tuple[list[int], list[Logprobs | None]]:
    """Pick one token per row of `logits` [batch, vocab]; `banned[i]` lists tokens row i may not pick,
    `generated[i]` the tokens row i has generated so far, and `grammar[i]` (None, or a bias over the
    vocabulary: -inf for each token its grammar forbids next, 0 for the others) keeps row i to its grammar.
    Also returns each row's log-probabilities, if asked."""
    logits = logits.float()
    # Log-probabilities describe the model, not the choice: they are taken before anything edits the logits.
    # Indexing by a list copies, so the edits below leave them alone.
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    log_probs = logits[wanted].log_softmax(dim=-1) if wanted else None
    _penalise(logits, params, generated)
    _bias(logits, params)
    for row, tokens in enumerate(banned):
        if tokens:
            logits[row, tokens] = float("-inf")
    for row, bias in enumerate(grammar or []):
        if bias is not None:
            logits[row] += bias
    chosen = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        picked = _sample_rows(logits[rows], [params[r] for r in sampled_rows], [generators[r] for r in sampled_rows])
        chosen[rows] = picked
    tokens = chosen.tolist()
    logprobs: list[Logprobs | None] = [None] * len(params)
    for i, row in enumerate(wanted):
        logprobs[row] = _logprobs(log_probs[i], tokens[row], params[row].logprobs)
    return tokens, logprobs


def _penalise(logits: torch.Tensor, params: list[SamplingParams], generated: list[list[int]]) -> None:
    """Lower, in place, the logit of every token a row has generated: by frequency_penalty per occurrence
    plus presence_penalty once. Rows without penalties (or without tokens yet) are not touched."""
    rows = [row for row, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and generated[row]]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    width = max(len(generated[row]) for row in rows)
    # Shorter rows are padded with an extra column's id, cut off after counting, so all rows count at once.
    ids = torch.tensor([generated[row] + [vocab] * (width - len(generated[row])) for row in rows], device=device)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    counts = counts[:, :vocab]
    frequency = torch.tensor([params[row].frequency_penalty for row in rows], device=device).unsqueeze(1)
    presence = torch.tensor([params[row].presence_penalty for row in rows], device=device).unsqueeze(1)
    index = torch.tensor(rows, device=device)
    logits[index] -= frequency * counts + presence * (counts > 0)


def _bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's logit_bias to that row alone, in place; a bias at the floor bans its token. Ids past
    the vocabulary are skipped: the gateway refuses them, and one row must not fail the whole batch."""
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        pairs = [(token, bias) for token, bias in p.logit_bias if 0 <= token < vocab]
        if not pairs:
            continue
        ids = torch.tensor([token for token, _ in pairs], device=logits.device)
        biases = torch.tensor([float("-inf") if bias <= -BAN_BIAS else bias for _, bias in pairs],
                              device=logits.device)
        logits[row, ids] += biases


def _logprobs(log_probs: torch.Tensor, token: int, top: int) -> Logprobs:
    """`log_probs` is one row [vocab]; the top-k is taken per row so that it cannot depend on batch-mates.
    A count out of range is clamped rather than refused: a failing step would fail the whole batch."""
    values, ids = log_probs.topk(max(0, min(top, MAX_TOP_LOGPROBS)))
    return Logprobs(log_probs[token].item(), ids.tolist(), values.tolist())


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    sorted_logits, order = torch.sort(logits / temperature, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=device).unsqueeze(0)
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    outside = (probs.cumsum(dim=-1) - probs) >= top_p
    # Rounding can put the top token's "mass before" above a tiny top_p; it must stay.
    outside[:, 0] = False
    probs = probs.masked_fill(outside, 0.0)
    picks = [torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(len(params))]
    return order.gather(1, torch.stack(picks)).squeeze(1)
