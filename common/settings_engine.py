"""The worker's engine concerns: which engine runs the model and how (ENGINE, WORKER_*, PREFILL_*, DRAIN_*), and
the settings of ENGINE=vllm and ENGINE=sim."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import ClassVar

from common.errors import SettingsError
from common.settings_base import Concern, setting

OWN_ENGINE_SLOTS = 16  # WORKER_SLOTS=0 under ENGINE=hf or sim; under vLLM, 0 is `vllm serve`'s own choice


@dataclass(frozen=True)
class EngineSettings(Concern):
    title: ClassVar[str] = "Workers"
    engine: str = setting(
        "auto",
        "`hf`: the own engine; `vllm`: vLLM's engine in the worker ([below](#enginevllm)); `llamacpp`: llama.cpp's "
        "library in the worker, on a GGUF file ([below](#enginellamacpp)); `auto`: `vllm` where a GPU is visible "
        "and vLLM is installed; on the CPU `llamacpp` for a GGUF file of an architecture other than Llama, Qwen 2 "
        "and Qwen 3 where llama-cpp-python is installed; else `hf`; `sim`: no model, for measuring the control "
        "plane",
        choices=('auto', 'hf', 'vllm', 'llamacpp', 'sim'))
    worker_slots: int = setting(
        0,
        "sequences one worker runs at once (its batch size); `0`: the engine's own default, 16 for the own engine "
        "and `sim`, and under `ENGINE=vllm` what `vllm serve` picks on that device (128 on a CPU, 256 on most GPUs,"
        " 1024 on an H100 or H200)")
    worker_threads: int = setting(
        0,
        "torch CPU threads per worker; 0 keeps torch's default (all cores)")
    worker_device: str = setting(
        "auto",
        "`cuda` when a GPU is visible, else `cpu`; or set `cpu` / `cuda` / `cuda:1`")
    worker_dtype: str = setting(
        "auto",
        "`bfloat16` on CUDA, `float32` on CPU; or `float32` / `bfloat16` / `float16`")
    worker_quant: str = setting(
        "auto",
        "CPU weights: `auto` runs a local GGUF file's own blocks (any type llama.cpp writes, "
        "[below](#your-own-gguf-file)) for a Llama, Mistral, Qwen 2 or Qwen 3 model where the compiled kernels "
        "load, else `int8`; `none` on CUDA. Or `gguf`, `int8`, `none` (fp32); "
        "[docs/engine.md](docs/engine.md#which-path-runs)",
        choices=('auto', 'gguf', 'int8', 'none'))
    worker_native: str = setting(
        "auto",
        "the compiled CPU kernels, built on a worker's first start (C++ compiler and ninja; the worker image has "
        "them): `auto` uses them when they build, else the TorchScript layer with a warning; `on`: a failed build "
        "stops the worker; `off`: never",
        choices=('auto', 'on', 'off'))
    worker_isa: str = setting(
        "auto",
        "the widest instruction set the compiled kernels use: `auto` what the CPU has; `avx2` or `plain` caps it (a"
        " CPU or VM that advertises more than it runs well; comparing code paths on one host). At start the GGUF "
        "blocks' products at that level are checked against their plain loops' bits, and a level that differs is "
        "stepped down from, with a warning. torch's own kernels follow PyTorch's `ATEN_CPU_CAPABILITY`",
        choices=('auto', 'avx512', 'avx2', 'plain'))
    worker_batching: str = setting(
        "continuous",
        "`continuous`: sequences join and leave the batch at every step; `static`: a batch waits for the last to "
        "finish (for comparison only)")
    prefill_block: int = setting(
        0,
        "tokens per prefill forward and per prefix-cache block; `0`: by device (16 on CPU, 256 on CUDA)")
    prefill_chunk: int = setting(
        16,
        "tokens of each prompt one prefill step computes while streams are running, so a long prompt does not stall"
        " them (fewer the deeper into the prompt, at least 4; [docs/engine.md](docs/engine.md#which-path-runs)); "
        "`0`: whole prompts")
    prefix_cache_bytes: str = setting(
        "auto",
        "bound of the worker's prefix cache (keys and values of prompt blocks, least recently used out first), in "
        "bytes; `auto`: an eighth of the memory the worker has left once its model has loaded (the host's available"
        " memory, or its container's limit less its use where lower), at least 64 MiB, in its `prefix cache` log "
        "line; `0`: no prefix cache")
    drain_timeout: float = setting(
        25.0,
        "seconds a worker told to stop (SIGTERM) keeps finishing its requests; what is left then moves to another "
        "worker")
    drain_mode: str = setting(
        "auto",
        "`auto`: a worker told to stop hands its requests to the other workers at once when they have free slots "
        "for all of them, else finishes them; `finish`: always finishes them",
        choices=('auto', 'finish'))

    def slots(self) -> int:
        """The own engine's and the sim's sequences at once (WORKER_SLOTS; 0: their default)."""
        return self.worker_slots or OWN_ENGINE_SLOTS

    def prefix_cache_setting(self) -> int | None:
        """PREFIX_CACHE_BYTES: a bound in bytes (0: no prefix cache), or None for `auto` (sized by the worker from
        the memory it has once its model is loaded: worker/prefix.py)."""
        if self.prefix_cache_bytes == "auto":
            return None
        try:
            value = int(self.prefix_cache_bytes)
        except ValueError:
            raise SettingsError(f"PREFIX_CACHE_BYTES={self.prefix_cache_bytes!r}: expected auto or a number of "
                                "bytes") from None
        if value < 0:
            raise SettingsError(f"PREFIX_CACHE_BYTES={value}: must not be negative")
        return value

    def _rules(self) -> None:
        self.prefix_cache_setting()


@dataclass(frozen=True)
class VllmSettings(Concern):
    title: ClassVar[str] = "ENGINE=vllm"
    vllm_max_model_len: int = setting(
        0,
        "with `ENGINE=vllm`: the context vLLM serves, prompt and completion (`0`: the model's)")
    vllm_gpu_memory_utilization: float = setting(
        0.0,
        "with `ENGINE=vllm` on a GPU: the share of its memory vLLM takes (weights, activations, KV cache); `0`: "
        "vLLM's default")
    vllm_tensor_parallel_size: int = setting(
        1,
        "with `ENGINE=vllm`: GPUs one worker spreads the model over")
    vllm_enforce_eager: str = setting(
        "auto",
        "with `ENGINE=vllm`: `on` runs the model eagerly, `off` compiles it (CUDA graphs on a GPU); `auto` is eager"
        " on CPU (compiling takes minutes there) and compiled on a GPU",
        choices=('auto', 'on', 'off'))
    vllm_kv_cache_gb: float = setting(
        0.0,
        "with `ENGINE=vllm`: the KV cache's size in GiB; `0`: on a GPU what `VLLM_GPU_MEMORY_UTILIZATION` leaves, "
        "on CPU 2 GiB")
    vllm_engine_args: str = setting(
        "",
        "with `ENGINE=vllm`: any of `vllm serve`'s engine flags (`--quantization awq --kv-cache-dtype fp8 "
        "--max-num-batched-tokens 8192 --enable-lora ...`), parsed by vLLM's own parser and applied over the "
        "`VLLM_*` and `WORKER_*` settings; the model stays `MODEL`'s. A flag vLLM does not know, or values it "
        "refuses together, stop the worker at start naming this variable")

    def _rules(self) -> None:
        if not 0 <= self.vllm_gpu_memory_utilization <= 1:
            raise SettingsError(f"VLLM_GPU_MEMORY_UTILIZATION={self.vllm_gpu_memory_utilization}: expected [0, 1]")
        if self.vllm_tensor_parallel_size < 1:
            raise SettingsError(f"VLLM_TENSOR_PARALLEL_SIZE={self.vllm_tensor_parallel_size}: must be at least 1")
        try:
            shlex.split(self.vllm_engine_args)
        except ValueError as exc:
            raise SettingsError(f"VLLM_ENGINE_ARGS={self.vllm_engine_args!r}: {exc}") from None


@dataclass(frozen=True)
class SimSettings(Concern):
    title: ClassVar[str] = "ENGINE=sim"
    sim_step_ms: float = setting(
        20.0,
        "with `ENGINE=sim`: the fixed part of a step's time")
    sim_step_per_seq_ms: float = setting(
        0.5,
        "with `ENGINE=sim`: a step's time per running sequence")
