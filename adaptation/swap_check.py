"""Whether a freshly deployed draft version keeps its place: its live acceptance on the
domain it was trained for, against the version it replaced (pure; the adaptation
deployment feeds it the monitor's per-version counts).

Validation scored the candidate on held-back requests, a sample of the past; live traffic
is the test that counts. Once the new version has ``window_rounds`` drafted rounds on the
domain (every replica's), its newest rounds there (at least that many, in whole flushes)
give ``α̂ = A / (A + R)``; the reference is the old version's
α̂ over its last rounds on the domain, or, where the old version had too few there (the
length policy stops drafting a domain whose acceptance fell, so the drifted domain often
has few), the run's held-back agreement before training, which tracks α̂ (measured within
0.02 on the demo pair, docs/deployment.md). More than ``max_drop`` below the reference:
roll back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdec.stats import alpha_hat


@dataclass(frozen=True, slots=True)
class Counts:
    """Drafted rounds of one version on one domain, and their sufficient statistics."""

    rounds: int = 0
    accepted: int = 0  # A: accepted draft tokens
    rejections: int = 0  # R: rounds that ended in a rejection

    @property
    def alpha(self) -> float | None:
        return alpha_hat(self.accepted, self.rejections) if self.rounds else None


@dataclass(frozen=True, slots=True)
class SwapDecision:
    """What the watch concluded, and the figures it rests on."""

    decision: Literal["wait", "keep", "roll_back"]
    before: float | None  # the reference α̂ (None: none known)
    before_source: Literal["live", "held_back", "none"]
    after: float | None  # the new version's live α̂ so far
    rounds: int  # the new version's drafted rounds on the domain so far
    reason: str


def check_swap(
    before: Counts,
    after: Counts,
    held_back_before: float | None,
    *,
    window_rounds: int,
    max_drop: float,
    min_before_rounds: int,
    timed_out: bool = False,
) -> SwapDecision:
    """Judge the new version on ``after`` (its rounds on the domain since it serves)
    against ``before`` (the old version's last rounds there) or, with fewer than
    ``min_before_rounds`` of those, ``held_back_before`` (the run's agreement before
    training on the domain). ``wait`` until ``window_rounds`` rounds are in, unless
    ``timed_out``: then judged on what there is (kept when there is nothing)."""
    if before.rounds >= min_before_rounds:
        ref, source = before.alpha, "live"
    elif held_back_before is not None:
        ref, source = held_back_before, "held_back"
    else:
        ref, source = None, "none"
    now = after.alpha
    if after.rounds < window_rounds and not timed_out:
        return SwapDecision("wait", ref, source, now, after.rounds, "window not full")
    if now is None or ref is None:
        why = "no live rounds on the domain" if now is None else "no reference acceptance"
        return SwapDecision("keep", ref, source, now, after.rounds, f"kept: {why}")
    if now < ref - max_drop:
        why = f"live alpha {now:.3f} is more than {max_drop} below {ref:.3f} ({source})"
        return SwapDecision("roll_back", ref, source, now, after.rounds, why)
    why = f"live alpha {now:.3f} against {ref:.3f} ({source}) over {after.rounds} rounds"
    return SwapDecision("keep", ref, source, now, after.rounds, why)
