"""The own engine's model (ENGINE=hf): a Hugging Face model loaded on its device and put on its weights' path
(worker/weights), with its tokenizer, chat template and grammars."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from common.settings import Settings
from worker.hf.grammar import Grammars
from worker.prompts import Prompts, end_tokens, gguf_path, source
from worker.weights import paths, quant


@dataclass
class LoadedModel(Prompts):
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    max_length: int
    eos_token_ids: list[int]
    weights: str = "none"  # what the linear layers run on: gguf (the file's blocks), int8 or none (float)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Started on first use: the worker asks at once, tests and benchmarks only when they constrain."""
        return Grammars(self.tokenizer, self.vocab, self.eos_token_ids)

    @property
    def vocab(self) -> int:
        """Width of the logits: the most a request's top_k can mean."""
        return int(self.model.config.vocab_size)


def _device_and_dtype(settings: Settings) -> tuple[torch.device, torch.dtype]:
    device_name = settings.worker_device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if settings.worker_dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtypes[settings.worker_dtype]


def load_model(settings: Settings) -> LoadedModel:
    if settings.worker_threads > 0:
        torch.set_num_threads(settings.worker_threads)
    path, extra = source(settings)
    device, dtype = _device_and_dtype(settings)
    gguf_file = gguf_path(settings)
    # Before the slow part, so that a bad value fails at once.
    chosen = paths.choose(settings.worker_quant, device, gguf_file, quant.supported())
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).to(device).eval()
    taken = paths.apply(model, chosen, settings, gguf_file)
    eos_ids = end_tokens(model.generation_config.eos_token_id, tokenizer)
    max_length = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return LoadedModel(settings.model, model, tokenizer, device, int(max_length), eos_ids, taken)
