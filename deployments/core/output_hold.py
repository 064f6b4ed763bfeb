"""Outputs held back for requests that read only their end (``output_kind`` "final_only").

A non-streamed request without stop strings reads nothing between its first token and
its last. Publishing every round's tokens for it wakes the replica's long-poll, moves a
frame and runs the detokenizer once a round for nobody: about 0.7 ms of a core a round
at batch 1 on the demo pair over HTTP (py-spy of the replica), on whichever core is free
of the models, which in the actor shape is none. Its first output still goes at once:
the HTTP layer waits for every choice's first output before it answers (a refusal
becomes a status), and time to first token is measured on it. Later outputs merge here
until one finishes the request; a core that dies loses what it held, and the request
resumes from the tokens its client was sent, as any request does.

Pure: the core's loop calls it; nothing here touches models, threads or actors.
"""

from __future__ import annotations

from collections.abc import Hashable

from deployments.messages import EngineCoreOutput, OutputKind


class OutputHold:
    """The merged, unpublished outputs of final-only requests, by request id."""

    def __init__(self) -> None:
        self._held: dict[Hashable, EngineCoreOutput] = {}

    def __len__(self) -> int:
        return len(self._held)

    def offer(self, out: EngineCoreOutput, kind: OutputKind) -> EngineCoreOutput | None:
        """What to publish for ``out`` now: ``out`` itself for a delta request, a final-only
        request's first output (nothing held, its first tokens) or its end (merged with
        what was held); None while a final-only request runs on."""
        if kind == "delta":
            return out
        held = self._held.pop(out.request_id, None)
        merged = out if held is None else _merge(held, out)
        first = held is None and out.num_output_tokens == len(out.new_token_ids)
        if first or merged.finished or merged.error is not None:
            return merged
        self._held[out.request_id] = merged
        return None

    def drop(self, request_id: Hashable) -> None:
        """Forget a request that left the core (aborted, failed, or finished)."""
        self._held.pop(request_id, None)


def _merge(held: EngineCoreOutput, out: EngineCoreOutput) -> EngineCoreOutput:
    """One output for both: their tokens (and logprobs) in order, the later one's state."""
    logprobs = None
    if held.logprobs is not None or out.logprobs is not None:
        logprobs = (held.logprobs or []) + (out.logprobs or [])
    return EngineCoreOutput(
        out.request_id,
        held.new_token_ids + out.new_token_ids,
        out.finished,
        out.finish_reason,
        out.num_output_tokens,
        out.spec_counts,
        out.error,
        logprobs,
        held.prompt_logprobs if held.prompt_logprobs is not None else out.prompt_logprobs,
    )
