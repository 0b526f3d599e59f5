"""Request bodies of the seed-style routes and their translation into bus messages."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.protocol import SamplingParams, Submit, now


class SamplingFields(BaseModel):
    """Sampling controls shared by every generation route (defaults as in the seed)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(20, ge=1, le=1_000_000, description="Most tokens to generate.")
    temperature: float = Field(0.7, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(50, ge=-1, description="0 or -1 disables top-k.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Same seed, same text.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    min_tokens: int = Field(0, ge=0, description="Suppress end-of-sequence before this many tokens.")

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens)


class GenerateRequest(SamplingFields):
    prompt: str | None = Field(None, min_length=1)
    prompts: list[str] | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_kind_of_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give exactly one of 'prompt' or 'prompts'")
        if self.prompts is not None and not all(self.prompts):
            raise ValueError("every entry of 'prompts' must be a non-empty string")
        if self.min_tokens > self.max_tokens:
            raise ValueError("'min_tokens' cannot exceed 'max_tokens'")
        return self

    def submits(self) -> list[Submit]:
        prompts = self.prompts if self.prompts is not None else [self.prompt]
        return [Submit(new_request_id(), self.sampling(), prompt=p, submitted_at=now()) for p in prompts]


def new_request_id() -> str:
    return uuid.uuid4().hex
