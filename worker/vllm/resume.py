"""A migrated request's presence penalty under vLLM, on whichever model runner vLLM picks.

A moved request reaches vLLM as prompt plus the tokens another worker delivered, and vLLM penalises only what it
generates itself. The frequency penalty of the delivered tokens adds up with vLLM's, so it travels as a logit bias
(worker/vllm/engine.py). The presence penalty counts a token once, delivered or generated: each delivered token is
penalised here until vLLM generates it again, when vLLM's own penalty takes over. vLLM runs that as a logits
processor, and its two model runners take two interfaces (resume_v1.py, resume_v2.py); where the runner takes
none, the penalty travels as a bias too (`exact_presence` is then False): exact until vLLM generates a delivered
token again, which is then penalised twice.

This module is pure (no vLLM import): which interface, and the per-request part both processors share; the
engine loads the processor (worker/vllm/engine.py's presence_processor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.vllm import DELIVERED

V1 = "v1"  # vllm.v1.sample.logits_processor: the V1 model runners (vLLM up to 0.33)
V2 = "v2"  # vllm.v1.worker.gpu.sample.logits_processor: Model Runner V2, on CUDA and on x86 CPUs


@dataclass(frozen=True)
class Delivered:
    """What a migrated request carries for the presence penalty: the penalty and the distinct delivered tokens."""

    penalty: float
    tokens: tuple[int, ...]


def delivered(params: Any) -> Delivered | None:
    """The presence penalty a request's delivered tokens still owe (vLLM SamplingParams in), or None."""
    tokens = (getattr(params, "extra_args", None) or {}).get(DELIVERED)
    penalty = float(getattr(params, "presence_penalty", 0.0) or 0.0)
    if not tokens or not penalty:
        return None
    return Delivered(penalty, tuple(sorted(set(tokens))))


def runner_interface(config: Any, standalone_cpu: bool) -> str:
    """The logits-processor interface of the model runner vLLM builds for `config` (a VllmConfig): V1 or V2, or
    "" where the runner takes no custom processor (vLLM 0.34's standalone CPU runner, on CPUs without Triton
    other than x86). Up to 0.33 `use_v2_model_runner` decides (true on CUDA with Triton unless
    VLLM_USE_V2_MODEL_RUNNER=0); from 0.34 Model Runner V2 is the only one."""
    if hasattr(type(config), "use_v2_model_runner"):
        return V2 if config.use_v2_model_runner else V1
    return "" if standalone_cpu else V2
