"""What the frontend keeps per request, what it streams out, and the errors it raises.

Plain data (no Ray, no asyncio work):
:class:`deployments.frontend.engine_client.EngineClient` owns the live
:class:`RequestState` objects and the OpenAI layer turns :class:`RequestOutput` and
the errors into HTTP responses.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field

from deployments.frontend.detokenizer import IncrementalDetokenizer
from deployments.messages import EngineCoreRequest, TokenLogprob
from specdec.sampling import SamplingParams
from specdec.stats import SpecCounts


class EngineError(RuntimeError):
    """A request could not be completed; the message says why."""


class EngineOverloadedError(EngineError):
    """Too many requests are waiting; retry later (HTTP 503)."""


class InvalidRequestError(ValueError):
    """A request the engine refuses (HTTP 400); ``param`` names the offending input."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class RequestOutput:
    """A streamed piece of a request's output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecCounts  # the request's speculation so far
    text: str | None = None  # the new text the client receives (None without a tokenizer)
    logprobs: list[TokenLogprob] | None = None  # [new], when the request asked for them
    # the prompt's tokens after the first, in the same form (first output only, when the
    # request asked for prompt logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestState:
    request_id: str  # the caller's (in its outputs)
    seq_id: str  # the core's: this engine's own, never reused (see EngineClient._new_request)
    prompt_token_ids: list[int]
    params: SamplingParams
    k: int  # the request's draft length, or the policy's cap when ``auto``
    queue: asyncio.Queue
    detok: IncrementalDetokenizer | None = None
    output_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    domain: str = "default"
    auto: bool = False  # the length policy chooses k per round
    method: str = "draft_model"  # the proposer ("ngram": the core drafts by lookup)
    auto_method: bool = False  # the proposer choice picks it per round
    output_kind: str = "delta"  # when the core publishes its tokens (messages.OutputKind)

    def core_request(self) -> EngineCoreRequest:
        """What the core needs to start, or resume, this request."""
        return EngineCoreRequest(
            self.seq_id,
            self.prompt_token_ids,
            list(self.output_token_ids),
            asdict(self.params),
            self.k,
            self.domain,
            self.auto,
            self.method,
            self.auto_method,
            self.output_kind,
        )


def detokenize_until_stop(detok: IncrementalDetokenizer, new: list[int], final: bool):
    """``(tokens kept, their text, stopped)``: the text the client receives, cut at the
    first stop string, and only the tokens up to the one that completed it."""
    if not detok.stop:
        return new, detok.add(new, final=final), False
    text = ""
    for j, tok in enumerate(new):
        text += detok.add([tok], final=final and j == len(new) - 1)
        if detok.stopped:
            return new[: j + 1], text, True
    return new, text, False
