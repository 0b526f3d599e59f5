"""llama.cpp's C library through llama-cpp-python's low-level bindings (`llama_cpp.llama_cpp`, ctypes): a GGUF
model and one context whose KV cache holds every sequence by its sequence id, a batch of tokens from several
sequences decoded at once, each row's logits read back as numpy, a sequence's cells freed when it leaves. Only
these calls touch ctypes; the engine (worker/llamacpp/engine.py) sees token lists and arrays."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("worker")


class DecodeError(RuntimeError):
    pass


class NoRoom(DecodeError):
    """The KV cache has no cells for the batch (llama_decode's 1); the cache is as it was before the call."""


@dataclass(frozen=True)
class Row:
    """One token of a batch: `token` at position `pos` of sequence `seq`; `logits` whether its next-token logits
    are read back."""

    token: int
    pos: int
    seq: int
    logits: bool


# ggml's log levels (ggml.h); CONT continues the line before. The package's own callback maps an older numbering
# (it printed every tensor as it loaded and hid errors), so the library's lines come here instead.
_GGML_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
_CONTINUES = 5
_callback = None  # kept: ctypes must not free the function llama.cpp calls


def _library():  # type: ignore[no-untyped-def]  # the bindings, imported only where ENGINE=llamacpp runs
    global _callback
    import llama_cpp.llama_cpp as lib

    if _callback is None:
        last = [logging.DEBUG]

        def forward(level: int, text: bytes, _data: ctypes.c_void_p) -> None:
            last[0] = last[0] if level == _CONTINUES else _GGML_LEVELS.get(level, logging.DEBUG)
            if last[0] >= logging.WARNING:
                log.log(last[0], "llama.cpp: %s", text.decode(errors="replace").rstrip())

        _callback = lib.llama_log_callback(forward)
        lib.llama_log_set(_callback, ctypes.c_void_p(0))
    return lib


class Context:
    """A GGUF file loaded and one context over it: KV cells for `sequences` sequences of the model's whole context,
    but at most `most_cells`, shared (a unified cache: a sequence may take any share of it); `batch` tokens at most
    per decode."""

    def __init__(self, path: str, most_cells: int, sequences: int, batch: int, threads: int) -> None:
        lib = self.lib = _library()
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0  # the CPU build; a GPU build would offload by its own setting
        self.model = lib.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        self.vocab_handle = lib.llama_model_get_vocab(self.model)
        self.vocab = int(lib.llama_vocab_n_tokens(self.vocab_handle))
        self.context_length = int(lib.llama_model_n_ctx_train(self.model))
        params = lib.llama_context_default_params()
        cells = min(most_cells, sequences * self.context_length) if self.context_length > 0 else most_cells
        params.n_ctx = cells
        params.n_seq_max = sequences
        params.n_batch = params.n_ubatch = batch  # one micro-batch a step: its rows are computed in one pass
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not make a context of {cells} cells for {path}")
        self.cells = int(lib.llama_n_ctx(self.ctx))
        self.capacity = batch
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(batch, 0, 1)

    def eos_ids(self) -> list[int]:
        """The file's end-of-generation tokens that it names (end of sequence, end of turn)."""
        ids = {int(self.lib.llama_vocab_eos(self.vocab_handle)), int(self.lib.llama_vocab_eot(self.vocab_handle))}
        return sorted(i for i in ids if i >= 0)

    def decode(self, rows: list[Row]) -> np.ndarray:
        """Decode `rows` in one call; returns the logits [rows wanting them, vocab] in their order in `rows`."""
        if not rows or len(rows) > self.capacity:
            raise DecodeError(f"a batch of {len(rows)} tokens (1 to {self.capacity})")
        batch = self.batch
        batch.n_tokens = len(rows)
        for i, row in enumerate(rows):
            batch.token[i] = row.token
            batch.pos[i] = row.pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = row.seq
            batch.logits[i] = row.logits
        code = self.lib.llama_decode(self.ctx, batch)
        if code == 1:
            raise NoRoom("the KV cache is full")
        if code != 0:
            raise DecodeError(f"llama_decode returned {code}")
        wanted = [i for i, row in enumerate(rows) if row.logits]
        out = np.empty((len(wanted), self.vocab), dtype=np.float32)
        for n, i in enumerate(wanted):
            pointer = self.lib.llama_get_logits_ith(self.ctx, i)
            ctypes.memmove(out[n].ctypes.data, pointer, self.vocab * 4)
        return out

    def forget(self, seq: int) -> None:
        """Free every cell of sequence `seq` (removing a whole sequence never fails)."""
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None
