"""OpenAI's two logprobs shapes, from the engine's :class:`~deployments.messages.TokenLogprob`
per token: chat's list of token entries, and completions' parallel lists with text offsets.

A completions record is built up across outputs (a stream's chunks, or a whole
response): it carries ``_end``, where its next token's text starts, which
:func:`public` leaves out of the response.
"""

from __future__ import annotations

from typing import Any

from deployments.frontend.engine_client import RequestOutput
from deployments.messages import TokenLogprob

NOTHING = TokenLogprob(None, None)  # a token with nothing to report (a prompt's first)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def chat_logprobs(tokenizer, out: RequestOutput) -> list[dict[str, Any]]:
    """Chat's logprobs entries for ``out``'s tokens."""
    entries = []
    for tok, scored in zip(out.new_token_ids, out.logprobs or [], strict=False):
        text = token_text(tokenizer, tok)
        entries.append(
            {
                "token": text,
                "logprob": scored.logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (t := token_text(tokenizer, i)),
                        "logprob": v,
                        "bytes": list(t.encode("utf-8")),
                    }
                    for i, v in scored.top.items()
                ],
            }
        )
    return entries


def new_completion_logprobs(start: int) -> dict[str, Any]:
    """An empty completions-logprobs record whose next token starts at ``start``."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {**{k: [] for k in keys}, "_end": start}


def completion_logprobs(tokenizer, out: RequestOutput, acc: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's completions logprobs for ``out``'s tokens, appended to ``acc``.

    ``text_offset`` is where each token's text starts, counted over the token texts
    themselves (the echoed prompt first): the released text may lag behind them while
    a stop string could still complete, so it cannot be the reference.
    """
    return _append(tokenizer, acc, out.new_token_ids, out.logprobs or [])


def prompt_completion_logprobs(
    tokenizer, prompt_ids: list[int], first: RequestOutput | None
) -> dict[str, Any]:
    """A completions-logprobs record that starts with the prompt's tokens (echo with
    logprobs): the first one's logprob and alternatives are null, nothing precedes it."""
    scored = (first.prompt_logprobs if first is not None else None) or []
    scored = [NOTHING, *scored, *[NOTHING] * (len(prompt_ids) - 1 - len(scored))]
    return _append(tokenizer, new_completion_logprobs(0), prompt_ids, scored)


def _append(
    tokenizer, acc: dict[str, Any], token_ids: list[int], scored: list[TokenLogprob]
) -> dict[str, Any]:
    """Append each token with its log-probabilities to ``acc``; offsets continue from
    ``acc["_end"]``."""
    offset = acc["_end"]
    for tok, lp in zip(token_ids, scored, strict=False):
        text = token_text(tokenizer, tok)
        acc["tokens"].append(text)
        acc["token_logprobs"].append(lp.logprob)
        acc["top_logprobs"].append(
            None if lp.top is None else {token_text(tokenizer, i): v for i, v in lp.top.items()}
        )
        acc["text_offset"].append(offset)
        offset += len(text)
    acc["_end"] = offset
    return acc


def public(acc: dict[str, list]) -> dict[str, list]:
    """A completions-logprobs record as the response carries it (without ``_end``)."""
    return {k: v for k, v in acc.items() if not k.startswith("_")}
