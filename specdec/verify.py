"""Verification of a batch of rows straight from target logits, greedy rows on a fast path.

:func:`specdec.rejection.rejection_sample` works on dense probabilities ``p`` and ``q``
(``[batch, k + 1, vocab]``), which a sampled row needs. A greedy row needs neither: it
accepts while each draft equals the target's argmax and then commits the argmax at the
first mismatch (or the bonus position), which is exactly what ``rejection_sample`` does
for greedy rows. So greedy rows here only take an argmax over their logits, and only
sampled rows are transformed into probabilities and passed to the rejection sampler, as
a sub-batch. The results are identical; the cost of a greedy row is one argmax.

Host syncs per verification (the committed tokens must reach Python to be streamed, so
one read per round is the floor): greedy rows, one ``tolist`` of their argmaxes; sampled
rows, one read of their accepted counts and committed tokens together (which rows draw
from where is decided from the host's own lists; seeded rows draw from their generators
without a read). The draft side (``DraftModelProposer.propose``) feeds each step's tokens
to the next on the device and reads the drafts once at the end (each step only for rows
with penalties). Nothing else leaves the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.penalties import apply_history, needs_history
from specdec.qcodec import CompactQ, dequantize_q
from specdec.rejection import rejection_sample
from specdec.sampling import SamplingParams, probs_for


@dataclass
class VerifyRow:
    """One sequence's part of a verification pass."""

    params: SamplingParams
    draft_token_ids: list[int]  # k_i drafts (may be empty: a plain decode step)
    # [k_i, vocab] q for sampled rows: float16 weights (specdec.qcodec), their CompactQ
    # form from another actor, or a float32 distribution; None for greedy rows
    draft_probs: CompactQ | np.ndarray | torch.Tensor | None
    generator: torch.Generator | None  # the request's verify stream (None: global RNG)
    # The sequence so far, for history-dependent processing (specdec.penalties): needed
    # only when ``needs_history(params)``.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # The drafts are deterministic (n-gram lookup): q = δ at each draft, so a sampled row
    # accepts draft x with probability p(x) and recovers from p without x. ``draft_probs``
    # is then None: a one-hot q would cost a vocabulary per draft for nothing.
    point_mass: bool = False


def _with_history(logits: torch.Tensor, rows: Sequence[VerifyRow]) -> torch.Tensor:
    """``logits`` with each row's penalties and min_tokens applied at its positions
    ``0..k_i`` (position ``j`` given the drafts before it); the input itself when no row
    needs them, else a float32 copy (the caller's raw logits stay as they are)."""
    todo = [i for i, r in enumerate(rows) if needs_history(r.params)]
    if not todo:
        return logits
    out = logits.float().clone()  # [batch, n, vocab]
    for i in todo:
        r = rows[i]
        n = len(r.draft_token_ids) + 1
        out[i, :n] = apply_history(
            logits[i, :n], r.params, r.prompt_token_ids, r.output_token_ids, r.draft_token_ids
        )
    return out


def verify_rows(logits: torch.Tensor, rows: Sequence[VerifyRow]) -> list[tuple[list[int], int]]:
    """Verify every row against its target logits.

    logits: [batch, n, vocab] target logits; row ``i`` is valid for positions
            ``0..k_i`` (the newest committed token, then each draft).
    Returns per row the tokens it commits (accepted drafts, then the recovered or bonus
    token) and the number of accepted drafts.
    """
    results: list[tuple[list[int], int] | None] = [None] * len(rows)
    logits = _with_history(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        argmax = logits.index_select(0, index).argmax(dim=-1).tolist()  # [g, n]
        for row, i in enumerate(greedy):
            best = argmax[row]
            drafts = rows[i].draft_token_ids
            a = 0
            while a < len(drafts) and drafts[a] == best[a]:
                a += 1
            results[i] = ([*drafts[:a], best[a]], a)
    if sampled:
        _verify_sampled(logits, rows, sampled, results)
    return results  # type: ignore[return-value]


def _verify_sampled(logits, rows, sampled, results) -> None:
    k = max(len(rows[i].draft_token_ids) for i in sampled)
    vocab = logits.shape[-1]
    dev = logits.device
    index = torch.tensor(sampled, device=dev)
    target = logits.index_select(0, index)[:, : k + 1]  # [s, k + 1, vocab]
    if target.shape[1] < k + 1:  # every sampled row drafted less than the longest row
        target = torch.nn.functional.pad(target, (0, 0, 0, k + 1 - target.shape[1]))
    host = torch.device("cpu")  # built from Python lists, moved to ``dev`` by the sampler
    draft_ids = torch.zeros(len(sampled), k, dtype=torch.long, device=host)
    draft_probs = torch.zeros(len(sampled), k, vocab, device=dev)
    counts = [len(rows[i].draft_token_ids) for i in sampled]
    for row, i in enumerate(sampled):
        drafts, q = rows[i].draft_token_ids, rows[i].draft_probs
        n = counts[row]
        if n:
            draft_ids[row, :n] = torch.tensor(drafts, dtype=torch.long, device=host)
            if rows[i].point_mass:
                positions = torch.arange(n, device=dev)
                draft_probs[row, positions, draft_ids[row, :n].to(dev)] = 1.0
                continue
            if q is None:
                raise ValueError("a sampled row with drafts needs their draft probabilities")
            q = q.weights(dev) if isinstance(q, CompactQ) else torch.as_tensor(q, device=dev)
            q = dequantize_q(q)  # [n, shared ids] float32: zero past the draft's ids
            draft_probs[row, :n, : q.shape[-1]] = q
    params = [rows[i].params for i in sampled]
    p = probs_for(params, target)  # [s, k + 1, vocab]
    out = rejection_sample(
        draft_ids,
        torch.tensor(counts, dtype=torch.long, device=host),
        p,
        draft_probs,
        torch.zeros(len(sampled), dtype=torch.bool, device=host),
        [rows[i].generator for i in sampled],
        host_counts=counts,
        host_greedy=[False] * len(sampled),
    )
    for i, result in zip(sampled, out.to_host(), strict=True):  # one read for the sub-batch
        results[i] = result


def sample_next(
    last_logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators,
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
):
    """One token per row from ``[batch, vocab]`` logits; greedy rows take the argmax.

    ``histories``: per row ``(prompt ids, output ids)``, for rows whose params need them.
    """
    if histories is not None:  # one position per row, no drafts: as a verification pass
        rows = [
            VerifyRow(sp, [], None, None, prompt, output)
            for sp, (prompt, output) in zip(params, histories, strict=True)
        ]
        last_logits = _with_history(last_logits[:, None], rows)[:, 0]  # [batch, vocab]
    out = last_logits.argmax(dim=-1).tolist()
    for i, sp in enumerate(params):
        if not sp.is_greedy:
            probs = probs_for([sp], last_logits[i : i + 1])[0]
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i])[0])
    return out
