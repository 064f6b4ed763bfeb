"""Outputs held back for requests that read only their end (``output_kind`` "final_only").

A non-streamed request without stop strings reads nothing between its first token and
its last. Publishing every round's tokens for it wakes the replica's long-poll, moves a
frame and runs the detokenizer once a round for nobody: about 0.7 ms of a core a round
at batch 1 on the demo pair over HTTP (py-spy of the replica), on whichever core is free
of the models, which in the actor shape is none. Its first output still goes at once:
the HTTP layer waits for every choice's first output before it answers (a refusal
becomes a status), and time to first token is measured on it. Later outputs gather here
until one finishes or fails the request, or ``flush_tokens`` have gathered: that bound
keeps one output's frame small and limits what a core that dies takes with it (its
requests resume from the tokens their clients were sent, as every request does, and
compute the rest again).

Pure: the core's loop calls it; nothing here touches models, threads or actors.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from deployments.messages import EngineCoreOutput, OutputKind, TokenLogprob

# Tokens a final-only request gathers before they go anyway (~0.4 s of one sequence at
# the demo pair's batch-1 speed; a frame of a few hundred KiB with 20 top logprobs each).
FLUSH_TOKENS = 256


@dataclass
class _Held:
    """One request's outputs since its last published one, gathered in place (appending:
    a round costs what it adds, not what was held before)."""

    token_ids: list[int] = field(default_factory=list)  # [held]
    logprobs: list[TokenLogprob] | None = None  # [held], when the request asked for them


class OutputHold:
    """The gathered, unpublished outputs of final-only requests, by request id."""

    def __init__(self, flush_tokens: int = FLUSH_TOKENS) -> None:
        if flush_tokens < 1:
            raise ValueError("flush_tokens must be >= 1")
        self.flush_tokens = flush_tokens
        self._held: dict[Hashable, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def request_ids(self) -> list[Hashable]:
        """The requests holding outputs (for leak checks; one C-level copy of the keys,
        so safe to call beside the loop that changes them)."""
        return list(self._held)

    def offer(self, out: EngineCoreOutput, kind: OutputKind) -> EngineCoreOutput | None:
        """What to publish for ``out`` now: ``out`` itself for a delta request, and for a
        final-only one its first output (nothing held, its first tokens) or, merged with
        what was held, its end, its failure, or ``flush_tokens`` gathered; None while a
        final-only request runs on."""
        if kind == "delta":
            return out
        held = self._held.get(out.request_id)
        if held is None and out.num_output_tokens == len(out.new_token_ids):
            return out  # its first output (at max_tokens 1 also its last): at once
        if held is None:
            held = self._held[out.request_id] = _Held()
        held.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None:
            if held.logprobs is None:
                held.logprobs = []
            held.logprobs.extend(out.logprobs)
        ends = out.finished or out.error is not None
        if not ends and len(held.token_ids) < self.flush_tokens:
            return None
        del self._held[out.request_id]
        return EngineCoreOutput(
            out.request_id,
            held.token_ids,
            out.finished,
            out.finish_reason,
            out.num_output_tokens,
            out.spec_counts,
            out.error,
            held.logprobs,
            out.prompt_logprobs,
        )

    def drop(self, request_id: Hashable) -> None:
        """Forget a request that left the core (aborted, failed, or finished)."""
        self._held.pop(request_id, None)
