"""Log-probabilities the core reports: of committed tokens, and of a prompt's tokens.

Both are taken under the target's raw distribution (before the request's temperature,
filters and penalties, as vLLM reports them) and leave the core as Python floats.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from deployments.messages import TokenLogprob


def token_logprobs(logits, tokens: list[int], top: int | None) -> list[TokenLogprob] | None:
    """Log-probabilities of ``tokens`` with the ``top`` likeliest at each position.

    logits: [n, vocab], row j the target's logits for ``tokens[j]``.
    Returns one per token; None when not asked for.
    """
    if top is None or not tokens:
        return None
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, vocab]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top:
        values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # [n, top]
        tops = [
            dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    else:
        tops = [{} for _ in tokens]
    return [TokenLogprob(lp, t) for lp, t in zip(chosen, tops, strict=True)]


def score_prompt(runner, sid: Hashable, prompt: list[int], top: int) -> tuple[torch.Tensor, list]:
    """Prefill one prompt in chunks of ``prefill_chunk_size`` (at most the runner's
    ``max_num_batched_tokens``) and score it: the logits after its last token ([vocab]) and
    the log-probability of each token after the first. One chunk's logits ([chunk, vocab])
    at a time, so a long prompt never materialises [prompt, vocab]."""
    size = min(runner.prefill_chunk_size, runner.max_num_batched_tokens)
    scored: list = []
    last = None
    for start in range(0, len(prompt), size):
        chunk = prompt[start : start + size]
        logits = runner.forward_padded([sid], [chunk])[0]  # [chunk, vocab]
        following = prompt[start + 1 : start + 1 + len(chunk)]  # what each position predicts
        scored += token_logprobs(logits[: len(following)], following, top) or []
        last = logits[len(chunk) - 1].clone()  # not a view that would keep the chunk
        del logits
    return last, scored
