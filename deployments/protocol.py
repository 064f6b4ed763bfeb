"""OpenAI-compatible request and response models (the subset SpecServe serves).

Field names and meanings follow the OpenAI API so the official client works unchanged;
``speculation`` is SpecServe's extension for per-request control and reporting.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SpeculationOptions(BaseModel):
    """Per-request speculation control (SpecServe extension)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(default=True, description="Use speculative decoding for this request.")
    num_speculative_tokens: int | None = Field(
        default=None, ge=0, le=16, description="Draft length k; defaults to the server's setting."
    )


class _SamplingFields(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do, so that newer clients work.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="Served model name (see GET /v1/models).")
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(
        default=-1, ge=-1, description="Keep the k likeliest tokens; -1 or 0 disables."
    )
    seed: int | None = Field(
        default=None, ge=0, le=2**63 - 1, description="Seed for reproducible sampling."
    )
    stop: str | list[str] | None = Field(
        default=None, description="Up to 4 strings that end generation (not included in the text)."
    )
    n: int = Field(default=1, ge=1, description="Choices per prompt; only 1 is supported.")
    stream: bool = Field(default=False, description="Stream Server-Sent Events.")
    user: str | None = Field(default=None, max_length=256, description="End-user id (tenant).")
    speculation: SpeculationOptions | None = Field(
        default=None, description="SpecServe extension: per-request speculation control."
    )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(description="Prompt text, or a list of token ids.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"] = Field(description="Who wrote the message.")
    content: str = Field(description="Message text.")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    completion_tokens: int = Field(description="Tokens generated.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")


class SpeculationReport(BaseModel):
    """What speculation did for this request (SpecServe extension)."""

    enabled: bool = Field(description="Whether drafts were used.")
    num_speculative_tokens: int = Field(description="Draft length k used.")
    drafted: int = Field(description="Draft tokens proposed.")
    accepted: int = Field(description="Draft tokens accepted by the target.")
    acceptance_rate: float = Field(description="accepted / drafted.")
    mean_acceptance_length: float = Field(
        description="Tokens per verification round, counting the recovered/bonus token."
    )
    rounds: int = Field(description="Verification rounds that carried drafts.")
    cache_hits: int = Field(description="Rounds whose drafts were prepared during verification.")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationReport | None = None


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationReport


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    target: bool
    draft: bool
    draft_restarting: bool
    running: int
    waiting: int
    aborted: int = Field(description="Requests whose client left before they finished.")
