"""ENGINE=vllm: vLLM's engine behind worker/core.py's seam.

The worker's loop already steps an engine, so vLLM's `LLMEngine` runs in this process, step by step, with its
engine core in-process too (no second process, no core spinning while idle): one `step()` schedules, runs the
model once and returns what each request gained. vLLM samples (seeds, penalties, logit_bias, min_tokens,
ignore_eos, log-probabilities) and enforces grammars (its structured outputs with the guidance backend, given
the grammar the gateway built and checked); the text is ours: each token goes through the same detokenizer and
stop matcher as the own engine's (worker/detokenizer.py, worker/stops.py), so text deltas, stop strings held
back and migration replay behave alike, and a stop string ends its request with an abort, as vLLM's own
front end does.

A migrated request (`resume`: tokens another worker delivered) is sent as prompt plus those tokens, with its
max_tokens and min_tokens less what was delivered; their frequency and presence penalties become logit biases
(vLLM counts only tokens it generated) and its grammar starts from the state after them. A seeded request
starts its generator afresh after a move, as on the own engine.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Any

from common.errors import ErrorCode
from common.protocol import SamplingParams, TokenLogprob
from common.settings import Settings, env_names
from worker.core import GrammarError, PromptTooLong, StepKind, StepOutput, StepResult
from worker.detokenizer import Detokenizer
from worker.prefix import HeldPrefixes
from worker.stops import StopMatcher
from worker.vllm import DELIVERED
from worker.vllm.model import VllmModel, cpu_environment, engine_arguments, hf_directory, load_tokenizer_model

log = logging.getLogger("worker")

BAN_BIAS = 100.0  # a bias at or below minus this bans its token (common/protocol.py's logit_bias)


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


def resumed_biases(params: SamplingParams, resume: Tokens[int]) -> dict[int, float]:
    """logit_bias for vLLM: the request's own (a ban as minus infinity, as the own engine bans), plus, for a
    migrated request, the frequency penalty its delivered tokens carry, since vLLM counts only what it generated
    itself (frequency adds up across the two; presence, which does not, is worker/vllm/resume.py's)."""
    biases: dict[int, float] = {}
    for token, bias in params.logit_bias:
        biases[token] = float("-inf") if bias <= -BAN_BIAS else float(bias)
    if params.frequency_penalty:
        for token, count in Counter(resume).items():
            biases[token] = biases.get(token, 0.0) - params.frequency_penalty * count
    return biases


def sampling_arguments(params: SamplingParams, resume: Tokens[int]) -> dict[str, Any]:
    """vLLM's SamplingParams fields for one of our requests (n is always 1: the gateway sends each choice
    as a request of its own, with seed + i)."""
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
    biases = resumed_biases(params, resume)
    if biases:
        arguments["logit_bias"] = biases
    if resume and params.presence_penalty:
        arguments["extra_args"] = {DELIVERED: list(resume)}  # worker/vllm/resume.py's presence penalty
    return arguments


@dataclass
class _Sequence:
    request_id: str
    internal_id: str  # vLLM's own id of the request
    prompt_tokens: int
    params: SamplingParams
    detokenizer: Detokenizer
    stops: StopMatcher | None
    emitted: int  # tokens delivered so far, by this worker or (migrated) by others
    started: bool = False  # whether vLLM has sampled its first token here


class VllmPrefixes(HeldPrefixes):
    """The scheduler's cache-aware routing over vLLM's prefix cache (worker/prefix.py's HeldPrefixes): a block is
    named by vLLM's own hash of it, from the request just added, and held while vLLM's block pool keeps it."""

    def __init__(self, hashes_of_last: Callable[[], list[bytes]], block_pool: Any, block_size: int) -> None:
        super().__init__(None, block_size)
        self.hashes_of_last = hashes_of_last
        self.block_pool = block_pool

    def digests(self, prompt_ids: Tokens[int]) -> list[bytes]:
        return self.hashes_of_last()  # the worker remembers a request's keys right after adding it

    def stored(self, digest: bytes) -> bool:
        return self.block_pool.get_cached_block(digest, [0]) is not None


class VllmEngine:
    """worker/core.py's Engine over a vLLM LLMEngine whose engine core runs in this process."""

    name = "vllm"

    def __init__(self, model: VllmModel, llm: Any, slots: int, core: Any = None,
                 statistics: Callable[[], Any] = lambda: None) -> None:
        """`core`: vLLM's in-process engine core (None: its internals are out of reach); `statistics`: vLLM's
        scheduler statistics after its last step (worker/vllm/stats.py), or None."""
        self.model = model
        self.llm = llm
        self.slots = slots
        self.statistics = statistics
        self.sequences: dict[str, _Sequence] = {}
        self.by_internal: dict[str, str] = {}
        # Delivered tokens a migrated request's grammar must have seen, by vLLM's id, until vLLM builds it.
        self.replays: dict[str, list[int]] = {}
        # Each constrained request's matcher as vLLM built it, by vLLM's id: a parse that fails (past llguidance's
        # limits) makes vLLM end the answer with an end-of-sequence; here it fails the request, as on the own engine.
        self.matchers: dict[str, Any] = {}
        self.last_added = ""
        self.scheduler = getattr(core, "scheduler", None)
        self.routing = self._routing()
        self._hook_grammars()

    # -- what the worker loop reads

    @property
    def running_count(self) -> int:
        return sum(1 for s in list(self.sequences.values()) if s.started)

    @property
    def waiting_count(self) -> int:
        return sum(1 for s in list(self.sequences.values()) if not s.started)

    @property
    def cache_positions(self) -> int:
        """In the own engine's units (the worker's KV-cache gauge is this over slots x context): the share of
        vLLM's KV cache in use, from its statistics, times that; before its first statistics, our requests'."""
        stats = self.statistics()
        if stats is not None:
            return round(stats.kv_cache_usage * self.slots * self.model.max_length)
        return sum(s.prompt_tokens + s.emitted for s in list(self.sequences.values()))


    def has_work(self) -> bool:
        return bool(self.sequences)

    # -- requests in and out

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            resume: list[int] | None = None) -> None:
        resume = list(resume or [])
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty after tokenisation")
        if len(prompt_ids) + len(resume) >= self.model.max_length:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                f"{self.model.max_length} tokens, prompt and completion together")
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        arguments = sampling_arguments(params, resume)
        if params.grammar:
            arguments["structured_outputs"] = StructuredOutputsParams(grammar=as_lark(params.grammar))
        if resume and params.grammar and not self.grammars_hooked:
            raise GrammarError("this vLLM build cannot resume a constrained request after a migration")
        try:
            internal = self.llm.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids + resume),
                                            VllmParams(output_kind=RequestOutputKind.DELTA, **arguments))
        except ValueError as exc:
            if params.grammar and "grammar" in str(exc).lower():
                raise GrammarError(str(exc)) from None
            raise
        if resume and params.grammar:
            self.replays[internal] = resume
        sequence = _Sequence(request_id, internal, len(prompt_ids), params,
                             Detokenizer(self.model.tokenizer, prompt_ids),
                             StopMatcher(params.stop) if any(params.stop) else None, 0)
        for token in resume:
            # Replayed as the lost worker emitted them, so that held-back text continues exactly.
            self._text(sequence, token, last=False)
        self.sequences[request_id] = sequence
        self.by_internal[internal] = request_id
        self.last_added = internal

    def cancel(self, request_id: str) -> bool:
        sequence = self.sequences.pop(request_id, None)
        if sequence is None:
            return False
        self._forget(sequence)
        self.llm.abort_request([sequence.internal_id], internal=True)
        return True

    def abort_all(self) -> list[str]:
        dropped = list(self.sequences)
        internal = [s.internal_id for s in self.sequences.values()]
        for sequence in list(self.sequences.values()):
            self._forget(sequence)
        self.sequences.clear()
        if internal:
            try:
                self.llm.abort_request(internal, internal=True)
            except Exception:  # after a failed step vLLM may be in any state; its requests are ours to drop
                log.exception("vLLM could not abort its requests")
        return dropped

    def _forget(self, sequence: _Sequence) -> None:
        self.by_internal.pop(sequence.internal_id, None)
        self.replays.pop(sequence.internal_id, None)
        self.matchers.pop(sequence.internal_id, None)

    # -- one step

    def step(self) -> StepResult:
        if not self.sequences:
            return StepResult("idle")
        outputs: list[StepOutput] = []
        firsts = 0
        for request_output in self.llm.step():
            sequence = self.sequences.get(request_output.request_id)
            if sequence is None:  # cancelled meanwhile
                continue
            firsts += not sequence.started
            outputs += self._outputs(sequence, request_output)
        kind: StepKind = "prefill" if firsts and firsts == len(outputs) else "mixed" if firsts else "decode"
        return StepResult(kind if outputs else "prefill", outputs)

    def _outputs(self, sequence: _Sequence, request_output: Any) -> list[StepOutput]:
        completion = request_output.outputs[0]
        tokens = list(completion.token_ids)
        if not tokens and request_output.finished:  # ended without a token (an error, or aborted by vLLM)
            return [self._end_without_token(sequence, completion.finish_reason)]
        if self._grammar_failed(sequence):
            return [self._fail(sequence, "the grammar cannot be kept to: its parse failed", ErrorCode.INVALID_VALUE,
                               aborted=request_output.finished)]
        outputs = []
        for position, token in enumerate(tokens):
            ended = request_output.finished and position == len(tokens) - 1
            output = self._emit(sequence, token, self._reason(completion.finish_reason) if ended else None, ended)
            if sequence.params.logprobs is not None and completion.logprobs and position < len(completion.logprobs):
                output.logprob, output.top_logprobs = self._logprobs(token, completion.logprobs[position],
                                                                     sequence.params.logprobs)
            outputs.append(output)
            if output.finish_reason is not None:
                break
        return outputs

    def _emit(self, sequence: _Sequence, token: int, reason: str | None, ended: bool) -> StepOutput:
        """Token `token` of `sequence` as a StepOutput; `reason` is vLLM's, when `ended` says vLLM is done
        with the request. A stop string may end it here first: vLLM is then told to drop it."""
        sequence.started = True
        # An end-of-sequence token that ends the text adds none; what a stop string held goes out with it.
        eos = reason == "stop" and token in self.model.eos_token_ids
        text, stopped = self._text(sequence, token, last=reason is not None, eos=eos)
        if stopped:
            reason = "stop"
        if reason is not None:
            self.sequences.pop(sequence.request_id, None)
            self._forget(sequence)
            if not ended:
                self.llm.abort_request([sequence.internal_id], internal=True)
        return StepOutput(sequence.request_id, token, sequence.emitted - 1, text, reason, sequence.prompt_tokens)

    @staticmethod
    def _text(sequence: _Sequence, token: int, last: bool, eos: bool = False) -> tuple[str, bool]:
        """The text `token` adds, less what a stop string may still claim; whether a stop string completed.
        Stop strings count once min_tokens are out, as in vLLM."""
        sequence.emitted += 1
        text = "" if eos else sequence.detokenizer.push(token)
        if sequence.stops is None or sequence.emitted <= sequence.params.min_tokens:
            return text, False
        return sequence.stops.push(text, last=last)

    def _end_without_token(self, sequence: _Sequence, reason: str | None) -> StepOutput:
        code = ErrorCode.INVALID_VALUE if sequence.params.grammar else ErrorCode.ENGINE_ERROR  # a grammar vLLM refused
        return self._fail(sequence, f"vLLM ended the request without a token ({reason})", code, aborted=True)

    def _fail(self, sequence: _Sequence, message: str, code: ErrorCode, aborted: bool = False) -> StepOutput:
        """The request fails alone: it leaves vLLM (unless vLLM already dropped it) and this engine."""
        self.sequences.pop(sequence.request_id, None)
        self._forget(sequence)
        if not aborted:
            self.llm.abort_request([sequence.internal_id], internal=True)
        return StepOutput(sequence.request_id, -1, sequence.emitted, "", None, sequence.prompt_tokens,
                          error=message, error_code=code)

    def _grammar_failed(self, sequence: _Sequence) -> bool:
        matcher = getattr(self.matchers.get(sequence.internal_id), "ll_matcher", None)
        return matcher is not None and matcher.is_error()

    @staticmethod
    def _reason(vllm_reason: str | None) -> str | None:
        """vLLM's finish reason in ours: stop (end of sequence, or a grammar's end) or length."""
        if vllm_reason in ("stop", "length"):
            return vllm_reason
        return "stop" if vllm_reason is not None else None

    def _logprobs(self, token: int, ranked: dict[int, Any], top: int) -> tuple[TokenLogprob, list[TokenLogprob]]:
        """The chosen token's log-probability and the `top` most likely, in rank order, as the own engine
        reports them (the model's distribution before penalties, biases and temperature: vLLM's raw_logprobs).
        vLLM adds the chosen token to its top ones when it is not among them."""
        decode = self.model.tokenizer.decode
        best = sorted((rank.rank, t, rank.logprob) for t, rank in ranked.items() if rank.rank is not None)
        alternatives = [TokenLogprob(decode([t]), float(value)) for order, t, value in best if order <= top]
        return TokenLogprob(decode([token]), float(ranked[token].logprob)), alternatives[:top]

    # -- vLLM internals this engine reaches for (in-process engine core only); each optional

    def _routing(self) -> VllmPrefixes | None:
        scheduler = self.scheduler
        try:
            block_pool = scheduler.kv_cache_manager.block_pool
            block_size = int(scheduler.block_size)
        except AttributeError:
            log.warning("vLLM's block pool is out of reach: no prefix-cache report for routing")
            return None
        if not getattr(scheduler.cache_config, "enable_prefix_caching", False):
            return None
        return VllmPrefixes(self._last_hashes, block_pool, block_size)

    def _last_hashes(self) -> list[bytes]:
        request = self.scheduler.requests.get(self.last_added) if self.scheduler is not None else None
        return list(request.block_hashes) if request is not None else []

    def _hook_grammars(self) -> None:
        """Have vLLM's matcher of a migrated request consume the tokens it delivered before it constrains the
        next one: vLLM builds each request's grammar in its structured-output manager, which is wrapped here."""
        manager = getattr(self.scheduler, "structured_output_manager", None)
        build = getattr(manager, "_create_grammar", None)
        self.grammars_hooked = build is not None
        if build is None:
            log.warning("vLLM's grammar builder is out of reach: constrained requests cannot migrate here")
            return

        def create_grammar(request: Any) -> Any:
            grammar = build(request)
            self.matchers[request.request_id] = grammar
            replay = self.replays.pop(request.request_id, None)
            if replay and not grammar.accept_tokens(request.request_id, replay):
                raise GrammarError("the delivered tokens do not keep to the grammar")
            return grammar

        manager._create_grammar = create_grammar


def build(settings: Settings) -> tuple[VllmModel, VllmEngine]:
    """Load vLLM with our settings: the model written from its GGUF file if it is one, the engine core in this
    process, WORKER_SLOTS sequences (the heartbeat's slots)."""
    import torch

    cuda = torch.cuda.is_available()
    # Our VLLM_* settings are read by now; vLLM warns of every VLLM_ variable it does not know.
    for name in env_names():
        if name.startswith("VLLM_"):
            os.environ.pop(name, None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine is made
    if not cuda:
        for name, value in cpu_environment(settings).items():
            os.environ.setdefault(name, value)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from worker.vllm.resume import DeliveredPresence
    from worker.vllm.stats import EngineStats

    path = hf_directory(settings)
    arguments = {**engine_arguments(settings, path, cuda), "logits_processors": [DeliveredPresence]}
    EngineStats.model = settings.model
    llm = LLMEngine.from_engine_args(EngineArgs(**arguments), stat_loggers=[EngineStats])
    config = llm.vllm_config
    model = load_tokenizer_model(settings, path, int(config.model_config.max_model_len))
    core = getattr(llm.engine_core, "engine_core", None)  # the in-process engine core (None in another process)
    return model, VllmEngine(model, llm, int(config.scheduler_config.max_num_seqs), core,
                             lambda: EngineStats.latest)
