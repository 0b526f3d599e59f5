"""Next-token choice for a whole batch: presence and frequency penalties, then
greedy rows by argmax, sampled rows with temperature, top-k and top-p, each row
drawing from its own seeded generator so that its text does not depend on its
batch-mates. Rows that ask for them also get log-probabilities. Shared by the engines that pick tokens from
torch logits themselves (the own engine and llama.cpp's)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.protocol import BAN_BIAS, SamplingParams
from worker.output import Logprobs

if TYPE_CHECKING:
    from worker.grammar import Grammars
    from worker.output import SequenceText

log = logging.getLogger("worker")

# The most alternatives a row may ask log-probabilities for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# Below this temperature sampling is greedy in all but name, and dividing by it would overflow.
GREEDY_BELOW = 1e-5
# A top-p row without top_k looks for its nucleus among this many most likely tokens before it sorts them all.
NUCLEUS_CANDIDATES = 1024


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
    sampled_rows = [row for row, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if len(sampled_rows) == len(params):  # no copy of the logits, no argmax nobody takes
        chosen = _sample_rows(logits, params, generators)
    else:
        chosen = logits.argmax(dim=-1)
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            chosen[rows] = _sample_rows(logits[rows], [params[r] for r in sampled_rows],
                                        [generators[r] for r in sampled_rows])
    tokens = chosen.tolist()
    logprobs: list[Logprobs | None] = [None] * len(params)
    for i, row in enumerate(wanted):
        logprobs[row] = _logprobs(log_probs[i], tokens[row], params[row].logprobs)
    return tokens, logprobs


Pick = tuple[int, "Logprobs | None"]


def sample_each(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                banned: list[list[int]], generated: list[list[int]], grammar: list[torch.Tensor | None],
                request_ids: list[str]) -> list[Pick | None]:
    """`sample` for a batch in one call; should that call raise, each row is sampled alone (rows are
    independent, so the picks are the same), and only rows that raise get None: one request's bad row fails
    that request alone."""

    def pick(rows: slice) -> list[Pick]:
        tokens, logprobs = sample(logits[rows], params[rows], generators[rows], banned[rows], generated[rows],
                                  grammar[rows])
        return list(zip(tokens, logprobs, strict=True))

    try:
        return list(pick(slice(None)))
    except Exception:
        log.exception("sampling failed for the batch; sampling its rows one by one")
    picks: list[Pick | None] = []
    for row in range(len(params)):
        try:
            picks += pick(slice(row, row + 1))
        except Exception as exc:
            log.warning("sampling failed", extra={"request_id": request_ids[row], "error": str(exc)})
            picks.append(None)
    return picks


def sample_texts(logits: torch.Tensor, texts: list[SequenceText], generators: list[torch.Generator | None],
                 grammars: Grammars, eos_token_ids: list[int], device: torch.device | None = None
                 ) -> list[Pick | None]:
    """`sample_each` for sequences as worker/output.py holds them: an end of sequence banned while it must not
    come, penalties over every token delivered, each grammar's mask (its index built only if a row asks)."""
    matchers = [t.matcher for t in texts]
    biases = grammars.row_biases(matchers, device) if any(m is not None for m in matchers) else [None] * len(texts)
    eos = list(eos_token_ids)
    return sample_each(logits, [t.params for t in texts], generators, [eos if t.holds_eos() else [] for t in texts],
                       [t.tokens for t in texts], biases, [t.request_id for t in texts])


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
    """Each row's draw from its own distribution. Every row's candidates and weights are found before any row
    draws, so a row that cannot be sampled raises before its batch-mates have used their generators (the
    engine then samples them one by one, and they must draw what they would have drawn)."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    scaled = logits / temperature
    weighted = [_candidates(scaled[row], p) for row, p in enumerate(params)]
    return torch.tensor([_token(ids, weights, generator)
                         for (ids, weights), generator in zip(weighted, generators, strict=True)],
                        device=logits.device)


def _candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens one row may draw and their weights: its top_k most likely (all if top_k is 0), then the
    fewest of those, most likely first, whose probability, renormalised over the top_k, reaches top_p. Returns
    (None, weights over the vocabulary) when every token may be drawn, else (ids, weights of those ids).

    Sorting the whole vocabulary for every row took longer than the decode step itself at 16 rows. A top_k
    row takes a `topk` of its k; a top-p row without one looks for its nucleus among a few candidates first,
    since it nearly always lies among them, and sorts the vocabulary only when it does not."""
    vocab = logits.shape[-1]
    k = min(params.top_k, vocab) if params.top_k > 0 else vocab
    if k == vocab and params.top_p >= 1:
        weights = logits.softmax(dim=-1)
        _check(weights.sum())
        return None, weights
    if k < vocab:
        values, ids = logits.topk(k)
        probs = (values - values.logsumexp(dim=-1)).exp()
    else:
        total = logits.logsumexp(dim=-1)
        values, ids = logits.topk(min(NUCLEUS_CANDIDATES, vocab))
        probs = (values - total).exp()
        if probs.sum() < params.top_p:  # the nucleus reaches past the candidates
            values, ids = logits.sort(descending=True)
            probs = (values - total).exp()
    _check(probs.sum())
    # Keep a token while the mass before it is below top_p; rounding must not drop the most likely one.
    inside = (probs.cumsum(dim=-1) - probs) < params.top_p
    inside[0] = True
    return ids, probs * inside


def _token(ids: torch.Tensor | None, weights: torch.Tensor, generator: torch.Generator | None) -> int:
    index = _draw(weights, generator)
    return index if ids is None else int(ids[index])


def _check(mass: torch.Tensor) -> None:
    if not bool(torch.isfinite(mass)) or mass <= 0:
        raise ValueError("the row's probabilities are not finite numbers")


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to `weights` (1-d, finite, not all zero): the first whose
    running total passes a uniform draw below the whole. Double precision keeps a token of tiny weight at the
    end of a long vocabulary from being rounded away."""
    running = weights.double().cumsum(dim=0)
    point = torch.rand((), dtype=torch.float64, generator=generator, device=weights.device) * running[-1]
    return min(int(torch.searchsorted(running, point, right=True)), len(weights) - 1)
