"""OpenAI-compatible request and response models (the subset SpecServe serves).

Field names and meanings follow the OpenAI API so the official client works unchanged;
``speculation`` is SpecServe's extension for per-request control and reporting.

Unknown fields are refused (400 naming the field), and so are known OpenAI fields that
SpecServe does not implement unless they carry their neutral value (an
empty ``logit_bias``, ``response_format`` text, no tools): a client must never get a
200 for something that was silently not done.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, Strict, field_validator, model_validator

from deployments.config import _Strict
from specdec.sampling import MAX_LOGPROBS, MIN_REPETITION_PENALTY

TokenId = Annotated[int, Strict()]  # `true` is not token 1
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16


class SpeculationOptions(_Strict):
    """Per-request speculation control (SpecServe extension)."""

    enabled: bool = Field(default=True, description="Use speculative decoding for this request.")
    num_speculative_tokens: int | None = Field(
        default=None, ge=0, le=16, description="Draft length k; defaults to the server's setting."
    )
    method: Literal["draft_model", "ngram"] | None = Field(
        default=None,
        description="The proposer: 'draft_model' or 'ngram' (prompt lookup, no model). "
        "Unset: the server's (speculation.proposers, chosen per domain by measured "
        "goodput); a request that sets num_speculative_tokens alone uses the draft model.",
    )


class StreamOptions(_Strict):
    include_usage: bool | None = Field(
        default=False,
        description="Send a last chunk with `choices: []` and the request's usage.",
    )
    continuous_usage_stats: bool | None = Field(
        default=False,
        description="With include_usage: every chunk with choices also carries `usage` so "
        "far (its choice's prompt tokens and the tokens generated until then), as vLLM "
        "sends it (GuideLLM asks for it).",
    )


def _empty_only(what: str):
    """A validator for a field whose only supported values are null and empty."""

    def check(cls, v):
        if v:
            raise ValueError(f"{what} not supported by this server")
        return v

    return classmethod(check)


class _SamplingFields(_Strict):
    model: str = Field(description="Served model name (see GET /v1/models).")
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(
        default=1.0, ge=0.0, le=2.0, description="0 is greedy decoding; null means 1."
    )
    top_p: float | None = Field(
        default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; null means 1."
    )
    top_k: int = Field(
        default=-1, ge=-1, description="Keep the k likeliest tokens; -1 or 0 disables."
    )
    seed: int | None = Field(
        default=None, ge=0, le=2**63 - 1, description="Seed for reproducible sampling."
    )
    stop: str | list[str] | None = Field(
        default=None,
        description="Up to 4 strings that end generation, matched on the returned text "
        "(not included in it).",
    )
    n: int | None = Field(
        default=1,
        ge=1,
        le=MAX_N,
        description=f"Choices per prompt (up to {MAX_N}; at most 64 choices per request). "
        "Choice j of a seeded request samples with seed + j.",
    )
    stream: bool | None = Field(default=False, description="Stream Server-Sent Events.")
    stream_options: StreamOptions | None = Field(
        default=None, description="Streaming options; only with `stream: true`."
    )
    user: str | None = Field(default=None, max_length=256, description="End-user id (tenant).")
    metadata: dict[str, str] | None = Field(
        default=None, max_length=16, description="Free-form tags (up to 16), not interpreted."
    )
    ignore_eos: Annotated[bool, Strict()] | None = Field(
        default=False,
        description="Keep generating past end-of-sequence (and chat end-of-turn) tokens: "
        "exactly max_tokens tokens unless a stop string or stop_token_ids end it first "
        "(what benchmark clients send to fix output lengths).",
    )
    stop_token_ids: list[TokenId] | None = Field(
        default=None,
        max_length=MAX_STOP_TOKEN_IDS,
        description=f"Token ids that end generation (kept in the output), up to "
        f"{MAX_STOP_TOKEN_IDS}.",
    )
    repetition_penalty: float | None = Field(
        default=1.0,
        ge=MIN_REPETITION_PENALTY,
        le=2.0,
        description=f"Divide positive (multiply negative) logits of tokens already in the "
        f"prompt or output by this, in [{MIN_REPETITION_PENALTY}, 2]; 1 or null: none.",
    )
    frequency_penalty: float | None = Field(
        default=0.0,
        ge=-2.0,
        le=2.0,
        description="Subtract this times a token's count in the output from its logit.",
    )
    presence_penalty: float | None = Field(
        default=0.0,
        ge=-2.0,
        le=2.0,
        description="Subtract this from the logit of every token present in the output.",
    )
    min_tokens: int | None = Field(
        default=0,
        ge=0,
        description="No EOS (unless ignore_eos) or stop_token_ids before this many tokens "
        "(stop strings still end the text).",
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Not supported: only null, {} or biases of 0."
    )
    speculation: SpeculationOptions | None = Field(
        default=None, description="SpecServe extension: per-request speculation control."
    )

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v and any(b != 0 for b in v.values()):
            raise ValueError("logit_bias is not supported by this server (only biases of 0)")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="Prompt text or a list of token ids; or a batch of either (a list of "
        "texts or of token-id lists, up to 64): one choice per prompt, choice index = "
        "prompt index x n + sample."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Most tokens to generate; 0 only with echo (score the prompt).",
    )
    echo: bool | None = Field(default=False, description="Return the prompt before the completion.")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Log-probabilities of each returned token under the target model, "
        "with this many likeliest alternatives; with echo also the prompt's (the first "
        "token's is null: nothing precedes it).",
    )
    suffix: None = Field(default=None, description="Not supported: only null.")
    best_of: int | None = Field(default=None, ge=1, le=1, description="Only 1 is supported.")

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo (scoring the prompt)")
        return self


class TextPart(_Strict):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The part's text.")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who wrote the message (`developer` is rendered as `system`)."
    )
    content: str | list[TextPart] | None = Field(
        description="Message text, or a list of text parts; null only on assistant turns."
    )
    name: str | None = Field(default=None, max_length=256, description="Author name.")
    tool_call_id: str | None = Field(
        default=None, max_length=256, description="For `tool` messages: the call answered."
    )
    tool_calls: list[dict[str, Any]] | None = Field(
        default=None, description="Not supported: only null or []."
    )

    _no_tool_calls = field_validator("tool_calls")(_empty_only("tool calls are"))

    @model_validator(mode="after")
    def _null_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError("content may be null only on assistant messages")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"] = Field(description="Only plain text is supported.")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate (replaces max_tokens)."
    )
    logprobs: bool | None = Field(
        default=False, description="Return the tokens' log-probabilities."
    )
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Likeliest alternatives per token; needs logprobs: true.",
    )
    response_format: ResponseFormat | None = Field(default=None, description="Only text.")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="Not supported: only null or []."
    )
    tool_choice: Literal["none", "auto"] | None = Field(
        default=None, description="Only 'none' (or 'auto', the same without tools)."
    )
    parallel_tool_calls: bool | None = Field(default=None, description="Ignored without tools.")

    _no_tools = field_validator("tools")(_empty_only("tools are"))

    @model_validator(mode="after")
    def _logprob_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        return self


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    completion_tokens: int = Field(description="Tokens returned.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")


class SpeculationReport(BaseModel):
    """What speculation did for this request (SpecServe extension)."""

    enabled: bool = Field(description="Whether drafts were used.")
    num_speculative_tokens: int = Field(
        description="Draft length k: the request's own, else the most the policy may choose."
    )
    policy: str = Field(
        default="fixed",
        description="'goodput': k was chosen per round for the request's domain; 'fixed'.",
    )
    domain: str = Field(default="default", description="The traffic domain it counted for.")
    drafted: int = Field(description="Draft tokens proposed.")
    accepted: int = Field(description="Draft tokens accepted by the target.")
    acceptance_rate: float = Field(description="accepted / drafted.")
    mean_acceptance_length: float = Field(
        description="Tokens per verification round, counting the recovered/bonus token."
    )
    rounds: int = Field(description="Verification rounds that carried drafts.")
    cache_hits: int = Field(description="Rounds whose drafts were prepared during verification.")
    method: Literal["draft_model", "ngram", "none"] = Field(
        default="none",
        description="The proposer that drafted most of its rounds ('none': no round "
        "carried drafts); proposer_rounds has the split.",
    )
    proposer_rounds: dict[str, int] = Field(
        default_factory=dict,
        description="Rounds with drafts by proposer ('draft_model', 'ngram').",
    )
    ngram_drafted: int = Field(default=0, description="Of drafted, what n-gram lookup proposed.")
    ngram_accepted: int = Field(default=0, description="Of accepted, n-gram lookup's.")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="Each returned token's text.")
    token_logprobs: list[float | None] = Field(
        description="Its log-probability under the target (null for an echoed prompt's "
        "first token)."
    )
    top_logprobs: list[dict[str, float] | None] | None = Field(
        description="Likeliest alternatives (null for an echoed prompt's first token)."
    )
    text_offset: list[int] = Field(description="Where each token starts in the text.")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationReport | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChatLogprobs | None = None


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
    root: str = Field(
        description="The target model it serves (hub id or path), as vLLM reports it: "
        "`vllm bench serve` without --model reads it."
    )


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


class KVCacheUsage(BaseModel):
    """A worker's KV cache: slots allocated once at startup, each for max_model_len."""

    num_slots: int = Field(description="Slots allocated (sequences that can run at once).")
    used_slots: int = Field(description="Slots held by running sequences.")
    used_tokens: int = Field(description="Tokens cached over all running sequences.")
    capacity_tokens: int = Field(description="num_slots x max_model_len.")
    usage: float = Field(description="used_slots / num_slots; at 1 new requests wait.")
    allocated_bytes: int = Field(description="Bytes of keys and values allocated.")


class DraftChannelState(BaseModel):
    connected: bool = Field(description="The core's direct channel to its draft is up.")
    sent: dict[str, int] = Field(
        description="Round messages the core sent to its draft, by route: 'channel' (the "
        "direct connection) or 'ray' (actor calls: while it opens, or after it broke)."
    )


class RankState(BaseModel):
    rank: int = Field(
        description="Its index in the group (1 .. size - 1; rank 0 is the core, or the "
        "draft worker for a split draft)."
    )
    pid: int | None = Field(default=None, description="Its process, on rank 0's node.")
    calls: int | None = Field(
        default=None,
        description="Runner calls it has run for rank 0 (equal to rank 0's when it has caught up).",
    )
    error: str | None = Field(
        default=None,
        description="Why it did not answer (dead or hung: the group fails at "
        "its next pass and is replaced).",
    )


class TensorParallelState(BaseModel):
    size: int = Field(description="Ranks the model is split over (tensor_parallel_size).")
    calls: int = Field(
        description="Runner calls rank 0 (the core, or the draft worker) broadcast to the group."
    )
    ranks: list[RankState] = Field(description="The other ranks, as each answered.")


class Health(BaseModel):
    status: Literal["ok", "warming", "degraded", "unavailable"] = Field(
        description="ok: serving with speculation; warming: compiling the models' graphs "
        "at startup, requests wait for it (HTTP 200); degraded: serving target-only while a "
        "draft is replaced (HTTP 200); unavailable: cannot serve now (HTTP 503)."
    )
    target: bool = Field(description="The target worker is up.")
    draft: bool = Field(description="A draft worker is connected.")
    draft_restarting: bool = Field(description="A replacement draft is being started.")
    target_restarting: bool = Field(
        description="A replacement target is loading; requests wait and resume on it."
    )
    target_restarts: int = Field(description="Target replacements so far.")
    running: int = Field(description="Sequences in the engine core's batch.")
    waiting: int = Field(description="Sequences admitted to the core, not yet running.")
    kv_cache: KVCacheUsage | None = Field(
        default=None, description="The target's KV cache (None until the core reports)."
    )
    draft_kv_cache: KVCacheUsage | None = Field(
        default=None,
        description="The draft's KV cache: slots kept for the core's sequences, the spare "
        "ones lent to speculation branches (colocated: carved from the target's device "
        "budget). None without a draft, or while one is replaced.",
    )
    aborted: int = Field(description="Requests whose client left before they finished.")
    draft_version: int = Field(
        default=0,
        description="The draft weights this replica serves: 0 as deployed, n after the "
        "n-th adapted version (adaptation).",
    )
    draft_versions: dict[str, int] = Field(
        default_factory=dict,
        description="Per traffic domain, the draft version that drafted its latest round "
        "on this replica (with a monitor; a domain not drafted since the replica started "
        "is absent); it reaches draft_version with the domain's first round drafted after a "
        "swap.",
    )
    draft_channel: DraftChannelState | None = Field(
        default=None,
        description="The draft actor's round messages: whether the direct channel is "
        "connected, and messages sent by route. None with a colocated draft, the "
        "compiled_graph transport or direct_channel: false, or until the core reports.",
    )
    tensor_parallel: TensorParallelState | None = Field(
        default=None,
        description="A target split over ranks (target.tensor_parallel_size > 1): each "
        "rank as it answered the core. None for a whole target, or until the core reports.",
    )
    draft_tensor_parallel: TensorParallelState | None = Field(
        default=None,
        description="A draft split over ranks (draft.tensor_parallel_size > 1): each rank "
        "as it answered the draft worker (its rank 0). None for a whole or colocated draft, "
        "while one is replaced, or until the draft reports.",
    )
    error: str | None = Field(default=None, description="Why the replica cannot serve.")
