"""Request bodies and their translation into bus messages. The /generate and the
OpenAI routes share one set of sampling fields; only their defaults differ."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from common.protocol import ChatMessage, SamplingParams, Submit, Tool, now

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16
MAX_PROMPTS = 256
# A chat request without a token limit runs until end-of-sequence or the model's context; also the
# bound of every token count, and of top_k while no worker has told its vocabulary.
UNTIL_CONTEXT_ENDS = 2**31 - 1
MAX_TOKENS = UNTIL_CONTEXT_ENDS
MAX_TIMEOUT = 86400.0
# OpenAI's limits on logit_bias: so many entries, each bias within plus or minus this.
MAX_LOGIT_BIAS = 300
MAX_PRIORITY = 2**31 - 1
LOGIT_BIAS_RANGE = 100.0


def _encodable(value: str) -> str:
    """JSON's escapes can spell a lone surrogate, which is no character: the bus could not carry it."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at position {exc.start}") from None
    return value


# Every string a client sends is this type.
Text = Annotated[str, AfterValidator(_encodable)]
# A prompt given as token ids, as OpenAI's and vLLM's /v1/completions take it (the vocabulary bounds it later).
MAX_TOKEN_ID = 2**31 - 1
TokenIds = list[Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]]


class SamplingFields(BaseModel):
    """Sampling controls shared by every generation route (the /generate routes' defaults). Every bound is one
    the engine needs: integers fit its 64-bit tensors, floats are finite."""

    model_config = ConfigDict(allow_inf_nan=False)

    max_tokens: int = Field(20, ge=1, le=MAX_TOKENS, description="Most tokens to generate; at most the model's "
                            "context.")
    temperature: float = Field(0.7, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(50, ge=-1, le=MAX_TOKENS, description="0 or -1 turns top-k off; at most the vocabulary.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Same seed, same text.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="Suppress end-of-sequence before this many tokens.")
    stop: Text | list[Text] | None = Field(None, description=f"Up to {MAX_STOP_STRINGS} strings that end the text; "
                                         "the stop string itself is not returned.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT, description="Seconds the request may wait in the "
                                  "queue.")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="Lower runs first among the waiting "
                          "requests of this API key (vLLM's meaning); it never overtakes another key's fair share.")
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="Token id (a string) to a bias added to its logit, "
                                                "-100 to 100; -100 bans the token.")

    @model_validator(mode="after")
    def _check_sampling(self) -> SamplingFields:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("'min_tokens' cannot exceed 'max_tokens'")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} 'stop' strings are allowed")
        if any(not s for s in stops):
            raise ValueError("'stop' strings must not be empty")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """A key must spell a token id (the vocabulary bounds it later), a bias lie within OpenAI's range."""
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise ValueError(f"keys must be token ids; got {key[:40]!r}")
            if abs(bias) > LOGIT_BIAS_RANGE:
                raise ValueError(f"biases must lie within -100 and 100; got {bias} for {key}")
        return value

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; keys spelling one id alike ("07", "7") keep the last bias."""
        return tuple(sorted({int(key): bias for key, bias in (self.logit_bias or {}).items()}.items()))

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, seed_offset: int = 0, logprobs: int | None = None, grammar: str = "") -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or UNTIL_CONTEXT_ENDS, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=None if self.seed is None else (self.seed + seed_offset) % 2**63, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, stop=self.stop_strings(), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=logprobs, logit_bias=self.token_biases(),
            grammar=grammar)

    def submit(self, prompt: str | list[int] | None = None, messages: list[ChatMessage] | None = None,
               seed_offset: int = 0, logprobs: int | None = None, queue_timeout: float = 0.0, grammar: str = "",
               tools: list[Tool] | None = None) -> Submit:
        submitted = now()
        wait = self.timeout or queue_timeout
        ids = prompt if isinstance(prompt, list) else None
        return Submit(new_request_id(), self.sampling(seed_offset, logprobs, grammar),
                      prompt=None if ids is not None else prompt, prompt_token_ids=ids,
                      messages=messages, tools=tools or [], submitted_at=submitted,
                      deadline=submitted + wait if wait else 0.0, priority=self.priority)


class GenerateRequest(SamplingFields):
    """`/generate` and `/generate_stream`, the native API."""

    model_config = ConfigDict(extra="forbid")

    prompt: Text | None = Field(None, min_length=1)
    prompts: list[Text] | None = Field(None, min_length=1, max_length=MAX_PROMPTS)

    @model_validator(mode="after")
    def _one_kind_of_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give exactly one of 'prompt' or 'prompts'")
        if self.prompts is not None and not all(self.prompts):
            raise ValueError("every entry of 'prompts' must be a non-empty string")
        return self

    def prompt_list(self) -> list[str]:
        return self.prompts if self.prompts is not None else [self.prompt]


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's extension: usage so far on every chunk.
    continuous_usage_stats: bool = False


JsonValue = dict | bool  # a JSON schema: an object, or true / false


class JsonSchemaFormat(BaseModel):
    name: Text = Field("response", max_length=64)
    description: Text | None = None
    # `schema` would shadow a BaseModel attribute.
    json_schema: JsonValue = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that keeps to a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when the type is 'json_schema'")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of a JSON schema, a regular expression, a choice of strings, a Lark (or
    GBNF) grammar, or any JSON object."""

    model_config = ConfigDict(populate_by_name=True)

    json_: JsonValue | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_PROMPTS)
    grammar: Text | None = None
    json_object: bool | None = None


class OpenAIFields(SamplingFields):
    """Fields of both OpenAI routes. Unknown fields are ignored, as OpenAI clients send extras."""

    model_config = ConfigDict(extra="ignore")

    model: Text = Field(..., min_length=1, description="A model id from GET /v1/models.")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate for each prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOKENS, description="0 or -1 turns top-k off (an extension, as in "
                       "vLLM); at most the vocabulary.")
    user: Text | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' fields.
    guided_json: JsonValue | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_PROMPTS)
    guided_grammar: Text | None = None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(OpenAIFields):
    prompt: Text | list[Text] | TokenIds | list[TokenIds] = Field(
        ..., description="A prompt or a list of prompts, each as text or as token ids.")
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="Most tokens to generate; at most the model's "
                            "context.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Log-probabilities of the chosen and top tokens.")
    echo: Literal[False] = Field(False, description="Echoing the prompt is not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, value: object) -> object:
        """Say in one message what is wrong with a prompt, not once for each shape it might have had."""
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            return value
        if not isinstance(value, list):
            raise ValueError("'prompt' must be a string, a list of strings, a list of token ids or a list of those")
        if all(isinstance(x, list) for x in value):
            lists = value
        elif not any(isinstance(x, list | str) for x in value):
            lists = [value]
        else:
            raise ValueError("'prompt' mixes kinds: give strings, or token ids, or lists of token ids")
        for ids in lists:
            wrong = next((t for t in ids if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID), None)
            if wrong is not None:
                raise ValueError(f"token ids must be integers from 0 to {MAX_TOKEN_ID}; got {wrong!r}")
        return value

    @model_validator(mode="after")
    def _prompts_not_empty(self) -> CompletionRequest:
        prompts = self.prompt_list()
        if not prompts or not all(prompts):
            raise ValueError("'prompt' must be a non-empty string or list of token ids, or a non-empty list of them")
        if len(prompts) * self.n > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts times 'n' per request")
        return self

    def prompt_list(self) -> list[str] | list[list[int]]:
        """Each prompt, as text or as token ids."""
        one = isinstance(self.prompt, str) or (bool(self.prompt) and isinstance(self.prompt[0], int))
        return [self.prompt] if one else self.prompt  # type: ignore[return-value]


def new_request_id() -> str:
    return uuid.uuid4().hex
