"""The own engine's model (ENGINE=hf): a Hugging Face model loaded on its device and put on its weights' path
(worker/weights), with its tokenizer, chat template and grammars."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from common.settings import WorkerSettings
from worker.grammar import Grammars
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

    @functools.cached_property
    def _current_forward(self) -> bool:
        """transformers 5.24 on: the cache is passed as `cache` and `logits_to_keep` takes a position per row;
        before, as `past_key_values`, and a tensor there keeps the same positions in every row."""
        return "cache" in inspect.signature(self.model.forward).parameters

    def logits(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: object,
               last: torch.Tensor | None) -> torch.Tensor:
        """[rows, vocab]: each row's logits at its token `last` (None: its last) through transformers' own forward
        over `cache`, on any transformers the worker extra allows."""
        if self._current_forward:
            keep = 1 if last is None else last[:, None]
            return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                              use_cache=True, logits_to_keep=keep).logits[:, -1]
        width = ids.shape[1]
        kept = 1 if last is None else width - int(last.min())
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=kept).logits
        return pick_rows(logits, width, last)


def pick_rows(logits: torch.Tensor, width: int, last: torch.Tensor | None) -> torch.Tensor:
    """Each row's logits at its position `last` (None: the last) of `width`, from logits [rows, kept, vocab] of
    the last `kept` positions of every row."""
    if last is None:
        return logits[:, -1]
    kept = logits.shape[1]
    return logits[torch.arange(len(logits), device=logits.device), last - (width - kept)]


def _device_and_dtype(settings: WorkerSettings) -> tuple[torch.device, torch.dtype]:
    device_name = settings.worker_device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if settings.worker_dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtypes[settings.worker_dtype]


def load_model(settings: WorkerSettings) -> LoadedModel:
    if settings.worker_threads > 0:
        torch.set_num_threads(settings.worker_threads)
    path, extra = source(settings)
    device, dtype = _device_and_dtype(settings)
    if device.type == "cuda":
        # cuDNN's attention plans a graph for each new shape, and a decode step's keys grow by one every step:
        # planning took more host time than the step's GPU work (docs/engine.md). Flash or memory-efficient
        # attention serve instead.
        torch.backends.cuda.enable_cudnn_sdp(False)
    gguf_file = gguf_path(settings)
    # Before the slow part, so that a bad value fails at once.
    chosen = paths.choose(settings.worker_quant, device, gguf_file, quant.supported())
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    model, taken = paths.load(settings, chosen, path, extra, device, dtype, gguf_file)
    eos_ids = end_tokens(model.generation_config.eos_token_id, tokenizer)
    max_length = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return LoadedModel(settings.model, model, tokenizer, device, int(max_length), eos_ids, taken)
