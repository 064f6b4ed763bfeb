"""The rejection sampler: a pure, batched function over tensors.

Implements the verification step of speculative sampling (Leviathan et al. 2023,
https://arxiv.org/abs/2211.17192; Chen et al. 2023, https://arxiv.org/abs/2302.01318), in
the spirit of vLLM's ``vllm/v1/sample/rejection_sampler.py``:

* greedy rows accept draft token ``x_i`` while it equals ``argmax p_i``;
* stochastic rows accept ``x_i ~ q_i`` iff ``u_i < p_i(x_i) / q_i(x_i)`` with ``u_i ~ U[0, 1)``;
* at the first rejection the *recovered* token is sampled from ``norm(max(0, p_i - q_i))``;
* if every draft token is accepted, the *bonus* token is sampled from ``p_{k+1}``.

The proposal ``q`` can be a full distribution, a point mass at each proposed token (any
deterministic proposer, e.g. n-gram lookup: ``q = δ_x``), or uniform over the vocabulary.
All three are exact: the output distribution equals sampling ``p`` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

PAD_TOKEN_ID = -1
ProposalKind = Literal["probs", "point_mass", "uniform"]


@dataclass
class RejectionOutput:
    """Result of one verification round for a batch of sequences."""

    output_token_ids: torch.Tensor  # [batch, k + 1] int64: accepted, then recovered/bonus; -1 pad
    num_accepted: torch.Tensor  # [batch] int64: accepted draft tokens (0..num_draft_tokens)
    bonus: torch.Tensor  # [batch] bool: all drafts accepted, last token sampled from p_{k+1}

    def tokens(self, row: int) -> list[int]:
        """The tokens that row ``row`` commits this round (accepted + recovered/bonus)."""
        n = int(self.num_accepted[row]) + 1
        return self.output_token_ids[row, :n].tolist()

    def to_host(self) -> list[tuple[list[int], int]]:
        """Per row, the tokens it commits and its accepted drafts, in one read of the
        device for the whole batch (:meth:`tokens` reads per row)."""
        host = torch.cat([self.num_accepted[:, None], self.output_token_ids], dim=1).tolist()
        return [(row[1 : row[0] + 2], row[0]) for row in host]  # [batch, 1 + k + 1]


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    proposal: ProposalKind = "probs",
    *,
    host_counts: Sequence[int] | None = None,
    host_greedy: Sequence[bool] | None = None,
) -> RejectionOutput:
    """Verify draft tokens against the target distribution.

    draft_token_ids:  [batch, k] int64; entries at positions >= num_draft_tokens are ignored
    num_draft_tokens: [batch] int64 in [0, k]; rows may draft different amounts (0 = plain decode)
    target_probs:     [batch, k + 1, vocab] p after the sampling transform (one-hot if greedy)
    draft_probs:      [batch, k, vocab] q after the same transform; required iff proposal="probs"
    is_greedy:        [batch] bool; greedy rows use argmax matching and draw no random numbers
    generators:       batch entries; per-request generators (None: the global RNG)
    proposal:         "probs" (full q), "point_mass" (q = δ_x), "uniform" (q = 1/vocab)
    host_counts, host_greedy: num_draft_tokens and is_greedy as the caller already has them
                      on the host (read from the tensors when not given)

    Each seeded row draws exactly ``num_draft_tokens[row]`` uniforms and then one
    categorical sample from its own generator, so a seeded request is reproducible
    whatever else is in the batch.
    """
    batch, k = draft_token_ids.shape
    _check_inputs(draft_token_ids, target_probs, draft_probs, generators, proposal)

    # Everything follows the target's probabilities onto their device. Host syncs: none
    # when the caller gives the greedy flags and draft counts on the host (else one read
    # each); then the caller's read of the output (RejectionOutput.to_host).
    device = target_probs.device
    greedy_host = list(host_greedy) if host_greedy is not None else is_greedy.tolist()
    counts_host = list(host_counts) if host_counts is not None else num_draft_tokens.tolist()
    draft_token_ids = draft_token_ids.to(device)
    if draft_probs is not None:
        draft_probs = draft_probs.to(device)
    num_draft_tokens = num_draft_tokens.to(device)
    is_greedy = is_greedy.to(device)
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_draft_tokens[:, None]  # [batch, k]
    safe_draft = torch.where(valid, draft_token_ids, torch.zeros_like(draft_token_ids))

    p_x, q_x = _probs_at_drafts(target_probs, draft_probs, safe_draft, proposal)  # [batch, k]
    seeded, unseeded = _random_streams(generators, greedy_host, device)
    uniforms = _draw_uniforms(batch, k, unseeded, seeded, counts_host, generators, device)
    # u ~ U[0, 1): accept iff u < p/q, i.e. with probability min(1, p/q).
    stochastic_accept = uniforms * q_x < p_x
    greedy_accept = safe_draft == target_probs[:, :k].argmax(dim=-1)
    accept = torch.where(is_greedy[:, None], greedy_accept, stochastic_accept) & valid
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    bonus = num_accepted == num_draft_tokens

    rows = torch.arange(batch, device=device)
    p_at = target_probs[rows, num_accepted]  # [batch, vocab]
    last_dist = _last_distribution(
        p_at, draft_probs, safe_draft, rows, num_accepted, bonus, proposal
    )
    last = _sample_last(p_at, last_dist, unseeded, seeded, generators)  # [batch]
    out = _output_tokens(draft_token_ids, positions, rows, num_accepted, last)
    return RejectionOutput(output_token_ids=out, num_accepted=num_accepted, bonus=bonus)


def _check_inputs(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
    proposal: ProposalKind,
) -> None:
    """Refuse shapes and kinds :func:`rejection_sample` would misread (a wrong shape could
    broadcast silently and verify against the wrong distribution)."""
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [batch, k + 1, vocab], got {tuple(target_probs.shape)}"
        )
    if proposal == "probs":
        if draft_probs is None or draft_probs.shape != (batch, k, vocab):
            raise ValueError("proposal='probs' needs draft_probs of shape [batch, k, vocab]")
    elif proposal not in ("point_mass", "uniform"):
        raise ValueError(f"unknown proposal kind {proposal!r}")
    if len(generators) != batch:
        raise ValueError(f"need one generator (or None) per row: {len(generators)} != {batch}")


def _probs_at_drafts(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    safe_draft: torch.Tensor,
    proposal: ProposalKind,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``p_i(x_i)`` and ``q_i(x_i)``, each ``[batch, k]``: the two sides of the acceptance
    test at every draft position (``safe_draft``: ``[batch, k]``, 0 past a row's drafts)."""
    k = safe_draft.shape[1]
    vocab = target_probs.shape[-1]
    p_x = target_probs[:, :k].gather(-1, safe_draft.unsqueeze(-1)).squeeze(-1)
    if proposal == "probs":
        q_x = draft_probs.gather(-1, safe_draft.unsqueeze(-1)).squeeze(-1)
    elif proposal == "point_mass":
        q_x = torch.ones_like(p_x)
    else:
        q_x = torch.full_like(p_x, 1.0 / vocab)
    return p_x, q_x


def _random_streams(
    generators: Sequence[torch.Generator | None], greedy_host: list[bool], device: torch.device
) -> tuple[list[int], torch.Tensor | None]:
    """Which rows draw from where: the seeded sampled rows (a list, each drawing from its
    own generator) and the ``[batch]`` bool mask of unseeded sampled rows (sharing one
    draw from the global RNG; None when there are none). Greedy rows are in neither:
    they draw nothing. Decided from the host's lists: no read of the device."""
    seeded = [r for r, g in enumerate(generators) if g is not None and not greedy_host[r]]
    unseeded = [g is None and not greedy for g, greedy in zip(generators, greedy_host, strict=True)]
    if not any(unseeded):
        return seeded, None
    return seeded, torch.tensor(unseeded, dtype=torch.bool, device=device)


def _draw_uniforms(
    batch: int,
    k: int,
    unseeded: torch.Tensor | None,
    seeded: list[int],
    counts_host: list[int],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """``u ~ U[0, 1)``, ``[batch, k]``: one shared draw for the unseeded rows, then exactly
    ``num_draft_tokens[row]`` per seeded row from its own generator (so a seeded request's
    stream does not depend on its batch); 0 for greedy rows and past a seeded row's drafts."""
    uniforms = torch.zeros(batch, k, device=device)
    if k > 0:
        if unseeded is not None:  # drawn for every row, kept on the unseeded ones
            uniforms = torch.where(unseeded[:, None], torch.rand(batch, k, device=device), 0.0)
        for row in seeded:
            n = counts_host[row]
            uniforms[row, :n] = torch.rand(n, generator=generators[row], device=device)
    return uniforms


def _last_distribution(
    p_at: torch.Tensor,
    draft_probs: torch.Tensor | None,
    safe_draft: torch.Tensor,
    rows: torch.Tensor,
    num_accepted: torch.Tensor,
    bonus: torch.Tensor,
    proposal: ProposalKind,
) -> torch.Tensor:
    """The law of each row's last token, ``[batch, vocab]``: the residual
    ``norm(max(0, p - q))`` at the first rejection, ``p_{n+1}`` after all drafts were
    accepted (``p_at``: ``[batch, vocab]``, p at position ``num_accepted``; ``rows``:
    ``arange(batch)``)."""
    k = safe_draft.shape[1]
    if k == 0:
        return p_at
    vocab = p_at.shape[-1]
    q_pos = num_accepted.clamp(max=k - 1)
    if proposal == "probs":
        q_at = draft_probs[rows, q_pos]
    elif proposal == "point_mass":
        q_at = torch.zeros_like(p_at).scatter(-1, safe_draft[rows, q_pos].unsqueeze(-1), 1.0)
    else:
        q_at = torch.full_like(p_at, 1.0 / vocab)
    residual = (p_at - q_at).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A rejection with zero residual mass only happens through rounding (p ~= q);
    # falling back to p there is exact up to that rounding.
    residual = torch.where(mass > 1e-12, residual / mass.clamp(min=1e-12), p_at)
    return torch.where(bonus[:, None], p_at, residual)


def _sample_last(
    p_at: torch.Tensor,
    last_dist: torch.Tensor,
    unseeded: torch.Tensor | None,
    seeded: list[int],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Each row's last token, ``[batch]`` int64: greedy rows take the argmax of p itself
    (the target's greedy token, whatever q was); sampled rows draw from ``last_dist``, the
    unseeded in one shared call, each seeded row from its own generator."""
    last = p_at.argmax(dim=-1)
    if unseeded is not None:  # drawn for every row, kept on the unseeded ones
        last = torch.where(unseeded, torch.multinomial(last_dist, 1)[:, 0], last)
    for row in seeded:
        last[row] = torch.multinomial(last_dist[row], 1, generator=generators[row])[0]
    return last


def _output_tokens(
    draft_token_ids: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    num_accepted: torch.Tensor,
    last: torch.Tensor,
) -> torch.Tensor:
    """``[batch, k + 1]`` int64: each row's accepted drafts, then its last token, then
    ``PAD_TOKEN_ID`` (``positions``: ``arange(k)``; ``rows``: ``arange(batch)``)."""
    batch, k = draft_token_ids.shape
    out = torch.full((batch, k + 1), PAD_TOKEN_ID, dtype=torch.long, device=last.device)
    keep = positions[None, :] < num_accepted[:, None]
    out[:, :k] = torch.where(keep, draft_token_ids, out[:, :k])
    out[rows, num_accepted] = last
    return out
