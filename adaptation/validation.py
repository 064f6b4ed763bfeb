"""Is an adapted draft better? Agreement with the target on held-back requests.

Why agreement: on a retained request the target's committed output is known, so a draft
can be scored without the target: at each output position, does the draft's likeliest
token (given the prompt and the committed output before it) equal the committed token?
For greedy traffic that is the chance the draft's token would have been accepted at that
position given that the positions before were; it ranks drafts as acceptance does, in one
teacher-forced pass per batch of requests.

A candidate is deployed only if it gains at least ``min_gain`` on the drifted domain and
loses at most ``max_loss`` on every other domain it can be scored on (:func:`judge`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from adaptation.distill import IGNORE, TrainingRow, collate


@torch.no_grad()
def agreement(
    model: torch.nn.Module, rows: Sequence[TrainingRow], pad_id: int = 0, batch_size: int = 32
) -> float:
    """Fraction of the rows' output positions where the model's argmax is the committed
    token (NaN without rows)."""
    device = next(model.parameters()).device
    hits = total = 0
    for start in range(0, len(rows), batch_size):
        ids, mask, labels = collate(rows[start : start + batch_size], pad_id, device)
        best = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)  # [b, n]
        scored = labels != IGNORE
        hits += int((best == labels)[scored].sum())
        total += int(scored.sum())
    return hits / total if total else float("nan")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a candidate draft is deployed, and why."""

    deploy: bool
    domain: str  # the drifted domain it was trained for
    gain: float  # agreement after - before on that domain
    worst_other: str | None  # the other domain that lost most (None: no other scored)
    worst_loss: float  # before - after there (0 when none)
    reason: str


def judge(
    before: Mapping[str, float],
    after: Mapping[str, float],
    domain: str,
    min_gain: float,
    max_loss: float = 0.05,
) -> Verdict:
    """Deploy iff the domain gains ``min_gain`` or more and no other domain loses more
    than ``max_loss`` (agreements per domain, before and after, on the same rows)."""
    gain = after[domain] - before[domain]
    # Domains the current draft could not be scored on say nothing; one the candidate
    # cannot be scored on counts as lost entirely.
    losses = {
        d: before[d] - after[d] if math.isfinite(after.get(d, math.nan)) else math.inf
        for d in before
        if d != domain and math.isfinite(before[d])
    }
    worst = max(losses, key=losses.get) if losses else None
    worst_loss = losses[worst] if worst is not None else 0.0
    if not gain >= min_gain:  # (NaN fails too)
        reason = f"{domain} gained {gain:+.3f}, less than min_gain {min_gain}"
        return Verdict(False, domain, gain, worst, worst_loss, reason)
    if worst is not None and not worst_loss <= max_loss:
        reason = f"{worst} lost {worst_loss:.3f}, more than {max_loss}"
        return Verdict(False, domain, gain, worst, worst_loss, reason)
    reason = f"{domain} gained {gain:+.3f}" + (
        f"; {worst} lost at most {worst_loss:.3f}" if worst else ""
    )
    return Verdict(True, domain, gain, worst, worst_loss, reason)


def split_held_back(
    rows: Sequence[TrainingRow], fraction: float, seed: int = 0
) -> tuple[list[TrainingRow], list[TrainingRow]]:
    """``(train, held back)``: ``fraction`` of the distinct rows (after a seeded shuffle)
    held back for validation, at least one when there are two or more. Repeated requests
    (retries, several choices of one prompt) count once, so none is on both sides."""
    order = list(dict.fromkeys(rows))
    random.Random(seed).shuffle(order)
    n_held = min(len(order) - 1, max(1, round(len(order) * fraction))) if len(order) > 1 else 0
    return order[n_held:], order[:n_held]
