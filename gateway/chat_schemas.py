"""Chat request bodies (`/v1/chat/completions`): messages with their content parts and tool calls, the tools a
request offers and its tool choice, on the OpenAI fields every route shares (gateway/schemas.py)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.errors import ErrorCode
from common.protocol import ChatMessage, Tool, ToolCall
from gateway.errors import ApiError
from gateway.schemas import MAX_PROMPTS, MAX_TOKENS, OpenAIFields, Text


class ContentPart(BaseModel):
    """One part of a message's content. Only text reaches the model; other kinds are refused by name."""

    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None
    refusal: Text | None = None


# The part kinds that carry text: a text part, and an assistant's refusal quoted back.
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


class CalledFunction(BaseModel):
    name: Text = Field(..., min_length=1, max_length=64)
    arguments: Text = Field("{}", description="JSON text, as the model wrote it.")


class MessageToolCall(BaseModel):
    """A call an assistant message made, quoted back in the conversation."""

    id: Text = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatRequestMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_PROMPTS)
    tool_call_id: Text | None = Field(None, max_length=256)
    name: Text | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatRequestMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("'content' is required, except for an assistant message with 'tool_calls'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        return self

    def message(self, param: str) -> ChatMessage:
        calls = tuple(ToolCall(c.id, c.function.name, _json_text(c.function.arguments, f"{param}.tool_calls"))
                      for c in self.tool_calls or [])
        return ChatMessage(self.role, self.text(f"{param}.content"), calls, self.tool_call_id or "")

    def text(self, param: str) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does). `param` names the field."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            field = TEXT_PARTS.get(part.type)
            text = getattr(part, field) if field else None
            if text is None:
                raise ApiError.of(ErrorCode.INVALID_VALUE, f"content parts of type '{part.type}' are not "
                                  "supported: the model takes text only", f"{param}[{j}]")
            texts.append(text)
        return "\n".join(texts)


class FunctionDefinition(BaseModel):
    name: Text = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict | None = Field(None, description="A JSON schema of the arguments; none: no arguments.")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition

    def tool(self) -> Tool:
        parameters = self.function.parameters if self.function.parameters is not None else NO_ARGUMENTS
        return Tool(self.function.name, self.function.description or "", json.dumps(parameters))


class FunctionName(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatRequestMessage] = Field(..., min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Deprecated by OpenAI; "
                                   "max_completion_tokens wins.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _one_token_limit(cls, data: object) -> object:
        # Either name sets the one limit the shared sampling fields know as max_tokens.
        if isinstance(data, dict) and data.get("max_completion_tokens") is not None:
            data = {**data, "max_tokens": data["max_completion_tokens"]}
        return data

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self

    @model_validator(mode="after")
    def _tools_known(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tool names must be distinct")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not among 'tools'")
        if self.tool_choice in ("required",) and not names:
            raise ValueError("tool_choice 'required' needs 'tools'")
        return self

    def chat_messages(self) -> list[ChatMessage]:
        return [m.message(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, and tool_choice not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"


NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _json_text(text: str, param: str) -> str:
    try:
        json.loads(text)
    except ValueError:
        raise ApiError.of(ErrorCode.INVALID_VALUE, "a tool call's arguments must be JSON text", param) from None
    return text
