"""The model side of ENGINE=vllm: the weights as the Hugging Face directory vLLM loads (written once from a
GGUF file, the default model's form), vLLM's engine arguments from our settings, and the tokenizer wrapper
that turns requests into token ids (worker/core.py's Model) with the chat template vLLM's directory holds.

vLLM itself is imported only where an engine is built (worker/vllm/engine.py): this module's pure parts are
tested without it."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from common.settings import DEFAULT_MODEL, WorkerSettings
from worker.prompts import BUNDLED_GGUF, Prompts, bundled_dir, end_tokens

log = logging.getLogger("worker")

# The KV cache on CPU unless VLLM_KV_CACHE_GB says: vLLM's own choice there is most of the machine's memory.
CPU_KV_CACHE_GB = 2
# Written beside a converted model: its presence means the directory is complete.
DONE_MARK = "llmserve-converted"


@dataclass
class VllmModel(Prompts):
    """What the worker loop asks of a model under ENGINE=vllm: the same prompts, chat template and
    /tokenize answers as the own engine's (worker/own/model.py's Prompts), from the tokenizer vLLM loads."""

    name: str
    path: str  # the Hugging Face directory (or hub id) vLLM serves
    tokenizer: PreTrainedTokenizerBase
    max_length: int
    eos_token_ids: list[int]
    vocab_size: int
    weights: str = "vllm"

    @property
    def vocab(self) -> int:
        return self.vocab_size


def cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve", "hf")


def gguf_source(settings: WorkerSettings) -> tuple[str, str] | None:
    """(directory, file) of the GGUF file the weights come from, when they do."""
    if settings.model == DEFAULT_MODEL:
        return bundled_dir(), BUNDLED_GGUF
    if settings.model_file and os.path.isfile(os.path.join(settings.model, settings.model_file)):
        return settings.model, settings.model_file
    return None


def converted_dir(gguf_path: str, root: str, weights_dtype: str = "float32") -> str:
    """Where the Hugging Face form of a GGUF file lives: named by the file, its size and time and the dtype
    it is written in, so that a changed file is written anew."""
    stat = os.stat(gguf_path)
    tag = hashlib.blake2b(f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}".encode(),
                          digest_size=6).hexdigest()
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    suffix = "" if weights_dtype == "float32" else f"-{weights_dtype}"
    return os.path.join(root, f"{stem}-{tag}{suffix}")


def hf_directory(settings: WorkerSettings, root: str | None = None, cuda: bool = False) -> str:
    """The directory (or hub id) vLLM loads for MODEL: a Hugging Face directory or id as it is; a GGUF file
    written out once as safetensors with its tokenizer, in the dtype vLLM serves it in (WORKER_DTYPE: bfloat16
    on a GPU, float32 on CPU), so that a GPU never holds a float32 copy."""
    source = gguf_source(settings)
    if source is None:
        return settings.model
    weights_dtype = dtype(settings.worker_dtype, cuda)
    target = converted_dir(os.path.join(*source), root or cache_root(), weights_dtype)
    if not os.path.exists(os.path.join(target, DONE_MARK)):
        write_hf_directory(*source, target, weights_dtype)
    return target


def write_hf_directory(directory: str, gguf_file: str, target: str, weights_dtype: str = "float32") -> None:
    """Dequantise the GGUF file to safetensors of `weights_dtype` in `target`. Written in a scratch directory
    and renamed into place, so two workers starting at once never read half a model."""
    import torch
    from transformers import AutoModelForCausalLM

    log.info("writing the model for vLLM", extra={"gguf": gguf_file, "target": target, "dtype": weights_dtype})
    os.makedirs(os.path.dirname(target), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".writing-", dir=os.path.dirname(target))
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file,
                                                     dtype=getattr(torch, weights_dtype))
        # The weights are plain floats now: the GGUF quantisation the config still names would mislead vLLM.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(scratch)
        AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file).save_pretrained(scratch)
        open(os.path.join(scratch, DONE_MARK), "w").close()
        try:
            os.rename(scratch, target)
        except OSError:  # another worker got there first: its copy is as good
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def load_tokenizer_model(settings: WorkerSettings, path: str, max_model_len: int) -> VllmModel:
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    generation = _generation_eos(path)
    return VllmModel(settings.model, path, tokenizer, max_model_len,
                     end_tokens(generation if generation is not None else config.eos_token_id, tokenizer),
                     int(config.vocab_size))


def _generation_eos(path: str) -> int | list[int] | None:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        return None


def enforce_eager(setting: str, cuda: bool) -> bool:
    """VLLM_ENFORCE_EAGER: auto is eager on CPU (torch.compile's warm-up takes minutes there) and compiled
    with CUDA graphs on a GPU."""
    return setting == "on" or (setting == "auto" and not cuda)


def dtype(setting: str, cuda: bool) -> str:
    """WORKER_DTYPE for vLLM: auto is bfloat16 on a GPU and float32 on CPU (the greedy answers of the own
    engine's float32)."""
    if setting != "auto":
        return setting
    return "bfloat16" if cuda else "float32"


def engine_arguments(settings: WorkerSettings, path: str, cuda: bool) -> dict[str, Any]:
    """vLLM's EngineArgs for our settings (VLLM_ENGINE_ARGS's flags go over them: worker/vllm/config.py): vLLM's
    prefix cache, the guidance (llguidance) backend for the grammars the gateway built, log-probabilities as many
    as the API allows, and WORKER_SLOTS sequences at once and VLLM_GPU_MEMORY_UTILIZATION where they are set
    (0: `vllm serve`'s choice)."""
    arguments: dict[str, Any] = {
        "model": path,
        "dtype": dtype(settings.worker_dtype, cuda),
        "enforce_eager": enforce_eager(settings.vllm_enforce_eager, cuda),
        "enable_prefix_caching": settings.prefix_cache_setting() != 0,
        "structured_outputs_config": {"backend": "guidance"},
        "max_logprobs": 20,
        "tensor_parallel_size": settings.vllm_tensor_parallel_size,
        "seed": 0,
    }
    if settings.vllm_gpu_memory_utilization:
        arguments["gpu_memory_utilization"] = settings.vllm_gpu_memory_utilization
    if settings.worker_slots:
        arguments["max_num_seqs"] = settings.worker_slots
    if settings.vllm_max_model_len:
        arguments["max_model_len"] = settings.vllm_max_model_len
    if cuda and settings.vllm_kv_cache_gb:
        arguments["kv_cache_memory_bytes"] = int(settings.vllm_kv_cache_gb * (1 << 30))
    return arguments


def cpu_environment(settings: WorkerSettings) -> dict[str, str]:
    """What vLLM's CPU backend reads from the environment: its KV-cache size (whole GiB), and the worker's
    threads for torch (WORKER_THREADS, else every core: vLLM takes one thread alone on a small machine)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(settings.vllm_kv_cache_gb or CPU_KV_CACHE_GB)))}
    threads = settings.worker_threads or os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = str(threads)
    return env
