"""History-dependent logit processing: repetition, frequency and presence penalties, min_tokens.

Unlike temperature or top-p, these depend on the tokens generated so far, and under
speculation "so far" includes the drafted tokens before each position: the distribution
at draft position ``j`` is the target's given the prompt, the committed output *and the
first ``j`` drafts*. The verifier must therefore process position ``j`` of a verification
pass with the drafts ``0..j-1`` counted, and the draft must process its own step ``j`` with
the same history. Rejection sampling stays exact because ``p`` at every position is then
exactly the distribution plain decoding would use after that prefix.

The formulas are vLLM's and OpenAI's (applied to raw logits, before temperature):

* repetition penalty ``r`` (1 disables): a token seen in the prompt or the output has its
  logit divided by ``r`` when positive, multiplied by ``r`` otherwise (as transformers'
  ``repetition_penalty`` and vLLM);
* frequency penalty ``f``: ``logit -= f * count`` of the token in the output;
* presence penalty ``s``: ``logit -= s`` for a token present in the output;
* ``min_tokens``: while fewer than ``min_tokens`` tokens are in the output, the
  request's stop tokens (:attr:`SamplingParams.all_stop_token_ids`: EOS unless
  ``ignore_eos``, and ``stop_token_ids``) get logit ``-inf``.

Token ids beyond the logits' width (a draft over fewer ids than the target) are not
counted: their probability is zero there anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.sampling import SamplingParams


def needs_history(params: SamplingParams) -> bool:
    """Whether ``params`` changes logits depending on the tokens so far."""
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or (params.min_tokens > 0 and bool(params.all_stop_token_ids))
    )


def _ids(tokens: Sequence[int], width: int, device) -> torch.Tensor:
    """``tokens`` below ``width`` as a device tensor ``[t]`` int64."""
    return torch.tensor([t for t in tokens if 0 <= t < width], dtype=torch.long, device=device)


def apply_history(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    draft_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """One row's logits with its penalties and min_tokens applied, position by position.

    logits: [n, vocab] raw logits of positions ``0..n-1``; position ``j`` follows the
            output plus the first ``j`` drafts (``draft_token_ids`` needs ``n - 1`` of them;
            extra ones are ignored).
    Returns a new float32 ``[n, vocab]`` tensor on the logits' device; ``logits`` is not
    modified (reported logprobs stay the raw model's, as vLLM's).
    """
    n, vocab = logits.shape
    dev = logits.device
    out = logits.float().clone()
    if not needs_history(params):
        return out
    drafts = list(draft_token_ids[: n - 1])
    # counts[j]: output tokens before position j ([n, vocab]): the committed output at
    # every position, plus a running count of the drafts before it.
    counts = torch.zeros(vocab, device=dev).scatter_add_(
        0, (done := _ids(output_token_ids, vocab, dev)), torch.ones(done.shape, device=dev)
    )
    counts = counts.expand(n, vocab).clone()
    if drafts:
        step = torch.zeros(n, vocab, device=dev)
        pos = torch.arange(1, len(drafts) + 1, device=dev)
        col = torch.tensor(drafts, dtype=torch.long, device=dev).clamp(0, vocab - 1)
        inside = torch.tensor([0 <= t < vocab for t in drafts], device=dev, dtype=torch.float32)
        step.index_put_((pos, col), inside, accumulate=True)
        counts += step.cumsum(0)
    seen = counts > 0  # [n, vocab]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
        in_prompt[_ids(prompt_token_ids, vocab, dev)] = True
        hit = seen | in_prompt
        r = params.repetition_penalty
        out = torch.where(hit, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty != 0.0:
        out -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        out -= params.presence_penalty * seen.float()
    short = params.min_tokens - len(output_token_ids)  # positions still under min_tokens
    if short > 0 and params.all_stop_token_ids:
        banned = _ids(params.all_stop_token_ids, vocab, dev)
        out[: min(short, n), banned] = float("-inf")
    return out
