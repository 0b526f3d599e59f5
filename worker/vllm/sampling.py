"""Our sampling settings as vLLM's: its SamplingParams fields for a request (a migrated one's too), its logit
biases, and the gateway's grammar as the Lark text vLLM takes; and its log-probabilities as ours."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence as Tokens
from typing import Any

from common.protocol import BAN_BIAS, SamplingParams
from worker.core import GrammarError
from worker.output import Logprobs
from worker.vllm import DELIVERED


def as_lark(grammar: str) -> str:
    """The gateway's llguidance grammar as the Lark text vLLM's `structured_outputs.grammar` takes: Lark as it
    is; llguidance's JSON form (a schema, or a regex's Lark) unwrapped; a JSON schema as Lark's `%json`."""
    if not grammar.lstrip().startswith("{"):
        return grammar
    try:
        parts = json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError) as exc:
        raise GrammarError(f"the grammar cannot be read: {exc}") from None
    if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict):
        raise GrammarError("only a grammar of one part can be given to vLLM")
    part = parts[0]
    if part.get("lark_grammar"):
        return part["lark_grammar"]
    if part.get("json_schema") is not None:
        return "start: %json " + json.dumps(part["json_schema"])
    raise GrammarError("the grammar has neither Lark text nor a JSON schema")


def resumed_biases(params: SamplingParams, resume: Tokens[int], exact_presence: bool = True) -> dict[int, float]:
    """logit_bias for vLLM: the request's own (a ban as minus infinity, as the own engine bans), plus, for a
    migrated request, the frequency penalty its delivered tokens carry, since vLLM counts only what it generated
    itself (frequency adds up across the two). Presence, which does not add up, is a logits processor's
    (worker/vllm/resume.py) where vLLM's model runner takes one; else it is a bias too (`exact_presence` False)."""
    biases: dict[int, float] = {}
    for token, bias in params.logit_bias:
        biases[token] = float("-inf") if bias <= -BAN_BIAS else float(bias)
    counts = Counter(resume)
    for token, count in counts.items():
        owed = params.frequency_penalty * count + (0.0 if exact_presence else params.presence_penalty)
        if owed:
            biases[token] = biases.get(token, 0.0) - owed
    return biases


def sampling_arguments(params: SamplingParams, resume: Tokens[int], exact_presence: bool = True) -> dict[str, Any]:
    """vLLM's SamplingParams fields for one of our requests (n is always 1: the gateway sends each choice
    as a request of its own, with seed + i). A migrated request's delivered tokens ride in `extra_args`, where
    the presence processor and the grammar replay read them inside vLLM."""
    left = params.max_tokens - len(resume)
    arguments: dict[str, Any] = {
        "n": 1,
        "max_tokens": left,
        "min_tokens": min(max(0, params.min_tokens - len(resume)), left),  # vLLM refuses more than max_tokens
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,
        "seed": params.seed,
        "ignore_eos": params.ignore_eos,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logprobs": params.logprobs,
        "detokenize": False,  # the text is made here, with replay across migrations
    }
    biases = resumed_biases(params, resume, exact_presence)
    if biases:
        arguments["logit_bias"] = biases
    if resume and (params.grammar or (params.presence_penalty and exact_presence)):
        arguments["extra_args"] = {DELIVERED: list(resume)}
    return arguments


def ranked(token: int, logprobs: dict[int, Any], top: int) -> Logprobs:
    """vLLM's log-probabilities of one position (token id -> its Logprob: rank, logprob) as the output processor
    takes them: the chosen token's and the `top` most likely, in rank order, as the own engine reports them (the
    model's distribution before penalties, biases and temperature: vLLM's raw_logprobs). vLLM adds the chosen
    token to its top ones when it is not among them."""
    best = sorted((rank.rank, t, rank.logprob) for t, rank in logprobs.items() if rank.rank is not None)
    kept = [(t, float(value)) for order, t, value in best if order <= top][:top]
    return Logprobs(float(logprobs[token].logprob), [t for t, _ in kept], [value for _, value in kept])
