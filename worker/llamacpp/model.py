"""ENGINE=llamacpp's model: the GGUF file (MODEL directory + MODEL_FILE, or the default model's bundled file) loaded
by llama.cpp, with the Hugging Face tokenizer and chat template transformers reads from the same file or
directory (worker/prompts.py), so prompts are the same ids on every engine, and grammars over that vocabulary."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.settings import WorkerSettings
from worker.grammar import Grammars
from worker.llamacpp.library import Context
from worker.prompts import Prompts, end_tokens, gguf_path, source

# KV cells of the context, shared by every sequence: what llama-server's default gives 16 slots of the default model
# (issue 44's peers ran with a 32k-token f16 cache); fewer where slots x context is less.
CELLS = 32768


@dataclass
class LlamaCppModel(Prompts):
    name: str
    tokenizer: PreTrainedTokenizerBase
    library: Context
    max_length: int
    eos_token_ids: list[int]
    weights: str = "gguf"

    @property
    def vocab(self) -> int:
        return self.library.vocab

    @functools.cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.tokenizer, self.vocab, self.eos_token_ids)


def gguf_file(settings: WorkerSettings) -> str:
    found = gguf_path(settings)
    if found is None:
        path, extra = source(settings)
        wanted = os.path.join(path, extra["gguf_file"]) if "gguf_file" in extra else f"MODEL={settings.model}"
        raise ValueError(f"ENGINE=llamacpp runs a GGUF file: set MODEL to its directory and MODEL_FILE to its name "
                         f"({wanted} is not one)")
    return found


def threads(settings: WorkerSettings) -> int:
    return settings.worker_threads if settings.worker_threads > 0 else (os.cpu_count() or 1)


def load(settings: WorkerSettings, slots: int, batch: int) -> LlamaCppModel:
    """The file in llama.cpp, a context of `slots` sequences and `batch` tokens a step, and its tokenizer."""
    file = gguf_file(settings)
    path, extra = source(settings)
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    library = Context(file, CELLS, slots, batch, threads(settings))
    # The model's context, but never more than the whole cache: one sequence must fit alone.
    max_length = min(library.context_length if library.context_length > 0 else library.cells, library.cells)
    eos = library.eos_ids() or end_tokens(None, tokenizer)
    return LlamaCppModel(settings.model, tokenizer, library, max_length, eos)
