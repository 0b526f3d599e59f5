"""ENGINE=vllm: vLLM's engine behind worker/core.py's seam.

The worker's loop already steps an engine, so vLLM's `LLMEngine` runs in this process, step by step, with its
engine core in-process too (no second process, no core spinning while idle): one `step()` schedules, runs the
model once and returns what each request gained. vLLM samples (seeds, penalties, logit_bias, min_tokens,
ignore_eos, log-probabilities) and enforces grammars (its structured outputs with the guidance backend, given
the grammar the gateway built and checked); the text is worker/output.py's, the output processor ENGINE=llamacpp
shares, so text deltas, stop strings held back, finish reasons and migration replay behave alike, and a stop
string ends its request with an abort, as vLLM's own front end does.

A migrated request (`resume`: tokens another worker delivered) is sent as prompt plus those tokens, with its
max_tokens and min_tokens less what was delivered; their frequency and presence penalties become logit biases
(vLLM counts only tokens it generated) and its grammar starts from the state after them. A seeded request
starts its generator afresh after a move, as on the own engine.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Any

from common.errors import ErrorCode
from common.protocol import SamplingParams
from common.settings import WorkerSettings, env_names
from worker.core import GrammarError, StepKind, StepOutput, StepResult
from worker.output import OutputProcessor, SequenceText
from worker.prefix import HeldPrefixes
from worker.vllm import DELIVERED
from worker.vllm.model import VllmModel, cpu_environment, hf_directory, load_tokenizer_model
from worker.vllm.resume import V1, V2, runner_interface
from worker.vllm.sampling import as_lark, ranked, sampling_arguments

log = logging.getLogger("worker")

@dataclass
class _Sequence:
    text: SequenceText  # what worker/output.py keeps of the request: its tokens and their text
    internal_id: str  # vLLM's own id of the request
    started: bool = False  # whether vLLM has sampled its first token here

    @property
    def request_id(self) -> str:
        return self.text.request_id

    @property
    def params(self) -> SamplingParams:
        return self.text.params


class VllmPrefixes(HeldPrefixes):
    """The scheduler's cache-aware routing over vLLM's prefix cache (worker/prefix.py's HeldPrefixes): a block is
    named by vLLM's own hash of it, from the request just added, and held while vLLM's block pool keeps it.
    The block pool is the engine loop's alone (vLLM takes no lock): the loop looks up which keys are held
    (`refresh`, after its steps) and the heartbeat thread reads that answer."""

    REFRESH_S = 0.25  # a heartbeat goes every HEARTBEAT_INTERVAL (1 s): fresher answers would go unread

    def __init__(self, hashes_of_last: Callable[[], list[bytes]], block_pool: Any, block_size: int) -> None:
        super().__init__(None, block_size)
        self.hashes_of_last = hashes_of_last
        self.block_pool = block_pool
        self.answer: list[int] = []
        self.refreshed = float("-inf")

    def refresh(self, at: float) -> None:
        if at - self.refreshed >= self.REFRESH_S:
            self.answer = super().held()
            self.refreshed = at

    def held(self, most: int = 512) -> list[int]:
        return self.answer[:most]

    def digests(self, prompt_ids: Tokens[int]) -> list[bytes]:
        return self.hashes_of_last()  # the worker remembers a request's keys right after adding it

    def stored(self, digest: bytes) -> bool:
        return self.block_pool.get_cached_block(digest, [0]) is not None


class VllmEngine:
    """worker/core.py's Engine over a vLLM LLMEngine whose engine core runs in this process."""

    name = "vllm"

    def __init__(self, model: VllmModel, llm: Any, slots: int, core: Any = None,
                 statistics: Callable[[], Any] = lambda: None, exact_presence: bool = True) -> None:
        """`core`: vLLM's in-process engine core (None: its internals are out of reach); `statistics`: vLLM's
        scheduler statistics after its last step (worker/vllm/stats.py), or None; `exact_presence`: whether
        vLLM runs worker/vllm/resume.py's processor (else a migrated presence penalty is a bias)."""
        self.model = model
        self.output = OutputProcessor(model.tokenizer, model.eos_token_ids, model.max_length)
        self.llm = llm
        self.slots = slots
        self.statistics = statistics
        self.exact_presence = exact_presence
        self.sequences: dict[str, _Sequence] = {}
        self.by_internal: dict[str, str] = {}
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
        return sum(s.text.prompt_tokens + s.text.emitted for s in list(self.sequences.values()))


    def has_work(self) -> bool:
        return bool(self.sequences)

    # -- requests in and out

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            resume: list[int] | None = None, background: bool = False) -> None:
        resume = list(resume or [])
        text = self.output.open(request_id, prompt_ids, params, resume)  # the prompt checked before vLLM sees it
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        arguments = sampling_arguments(params, resume, self.exact_presence)
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
        sequence = _Sequence(text, internal)
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

    def request_ids(self) -> set[str]:
        return set(self.sequences)

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
        if self.routing is not None:
            self.routing.refresh(time.monotonic())
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
                output.logprob, output.top_logprobs = self.output.logprobs(
                    token, ranked(token, completion.logprobs[position], sequence.params.logprobs))
            outputs.append(output)
            if output.finish_reason is not None:
                break
        return outputs

    def _emit(self, sequence: _Sequence, token: int, reason: str | None, ended: bool) -> StepOutput:
        """Token `token` of `sequence` through worker/output.py; `reason` is vLLM's, when `ended` says vLLM is
        done with the request. The text may end it here first (a stop string): vLLM is then told to drop it."""
        sequence.started = True
        output = self.output.emit(sequence.text, token, reason)
        if output.finish_reason is not None:
            self.sequences.pop(sequence.request_id, None)
            self._forget(sequence)
            if not ended:
                self.llm.abort_request([sequence.internal_id], internal=True)
        return output

    def _end_without_token(self, sequence: _Sequence, reason: str | None) -> StepOutput:
        code = ErrorCode.INVALID_VALUE if sequence.params.grammar else ErrorCode.ENGINE_ERROR  # a grammar vLLM refused
        return self._fail(sequence, f"vLLM ended the request without a token ({reason})", code, aborted=True)

    def _fail(self, sequence: _Sequence, message: str, code: ErrorCode, aborted: bool = False) -> StepOutput:
        """The request fails alone: it leaves vLLM (unless vLLM already dropped it) and this engine."""
        self.sequences.pop(sequence.request_id, None)
        self._forget(sequence)
        if not aborted:
            self.llm.abort_request([sequence.internal_id], internal=True)
        return self.output.fail(sequence.text, message, code)

    def _grammar_failed(self, sequence: _Sequence) -> bool:
        matcher = getattr(self.matchers.get(sequence.internal_id), "ll_matcher", None)
        return matcher is not None and matcher.is_error()

    @staticmethod
    def _reason(vllm_reason: str | None) -> str | None:
        """vLLM's finish reason in ours: stop (end of sequence, or a grammar's end) or length."""
        if vllm_reason in ("stop", "length"):
            return vllm_reason
        return "stop" if vllm_reason is not None else None

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
        next one: vLLM builds each request's grammar in its structured-output manager, which is wrapped here.
        The tokens come with the request itself (its extra_args), since vLLM may build the grammar on its own
        thread pool before add_request has returned."""
        manager = getattr(self.scheduler, "structured_output_manager", None)
        build = getattr(manager, "_create_grammar", None)
        self.grammars_hooked = build is not None
        if build is None:
            log.warning("vLLM's grammar builder is out of reach: constrained requests cannot migrate here")
            return

        def create_grammar(request: Any) -> Any:
            grammar = build(request)
            self.matchers[request.request_id] = grammar
            replay = (getattr(request.sampling_params, "extra_args", None) or {}).get(DELIVERED)
            if replay and not grammar.accept_tokens(request.request_id, replay):
                raise GrammarError("the delivered tokens do not keep to the grammar")
            return grammar

        manager._create_grammar = create_grammar


def presence_processor(interface: str) -> type | None:
    """worker/vllm/resume.py's processor for the runner's interface, or None where this vLLM lacks it."""
    if interface == V1 and importlib.util.find_spec("vllm.v1.sample.logits_processor") is not None:
        from worker.vllm.resume_v1 import DeliveredPresence

        return DeliveredPresence
    if interface == V2:
        from worker.vllm.resume_v2 import DeliveredPresenceV2

        return DeliveredPresenceV2
    return None


def build(settings: WorkerSettings) -> tuple[VllmModel, VllmEngine]:
    """Load vLLM with our settings and VLLM_ENGINE_ARGS (worker/vllm/config.py): the model written from its GGUF
    file if it is one, the engine core in this process, the presence penalty of migrated requests on the model
    runner vLLM picks (worker/vllm/resume.py); the heartbeat's slots are vLLM's max_num_seqs."""
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
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    from worker.vllm.config import engine_config
    from worker.vllm.stats import EngineStats

    path = hf_directory(settings, cuda=cuda)
    config = engine_config(settings, path, cuda)
    # Asked of the platform's class: vLLM's platform object answers a name it lacks with None and a warning.
    standalone = getattr(type(current_platform), "uses_standalone_cpu_model_runner", None)
    interface = runner_interface(config, standalone is not None and standalone())
    processor = presence_processor(interface)
    if processor is not None:
        config.model_config.logits_processors = [*(config.model_config.logits_processors or ()), processor]
    EngineStats.model = settings.model
    llm = LLMEngine.from_vllm_config(config, stat_loggers=[EngineStats])
    model = load_tokenizer_model(settings, path, int(config.model_config.max_model_len))
    core = getattr(llm.engine_core, "engine_core", None)  # the in-process engine core (None in another process)
    engine = VllmEngine(model, llm, int(config.scheduler_config.max_num_seqs), core, lambda: EngineStats.latest,
                        exact_presence=processor is not None)
    log.info("vLLM engine", extra={"model_runner": interface or "standalone", "exact_presence": processor is not None,
                                   "max_num_seqs": engine.slots,
                                   "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens})
    return model, engine
