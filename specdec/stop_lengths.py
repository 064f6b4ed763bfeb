"""Where a row's drafts end, pooled over every draft length asked: a decayed
Kaplan-Meier estimate (pure, no torch).

Why: a draft with a confidence stop makes ``min(L, k)`` drafts when asked for ``k``, where
``L`` (the first draft it was unsure of, or 0 when none came) depends on the text, not on
``k``. The length policy needs the drafts a row gets at every ``k`` it might choose. Kept
per asked ``k``, each mean rests on the few rounds run at that ``k``, and rounds differ by
the text (1 draft in one, 12 in the next): a few short rounds at a long ``k`` made it look
like a short one, and the policy stopped choosing it (measured on the demo pair at batch
1: the shipped goodput policy ran at 0.85x a fixed k = 12). Here every round says
something about every ``k``: a row that got ``n < k`` drafts ended at ``n``; one that got
all ``k`` it asked for went on past ``k - 1`` at least (censored at ``k``).

``hazard(j)`` = rows that ended at ``j`` / rows seen at ``j`` (rows that made ``j`` drafts
or more, less those that got exactly the ``j`` they asked for: whether they would have
ended there is unknown). The drafts a row gets at ``k`` are
``sum_{j=1..k} P(L >= j)`` with ``P(L >= j) = prod_{i<j} (1 - hazard(i))``; past the last
position seen, the last hazard seen carries on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopLengths:
    """Decayed counts of rows reaching and ending at each draft position."""

    decay: float = 0.98  # per observed round, of every count
    reached: dict[int, float] = field(default_factory=dict)  # position -> rows that got there
    ended: dict[int, float] = field(default_factory=dict)  # position -> rows that ended there

    def observe(self, rows: list[tuple[int, int]]) -> None:
        """One round: ``(drafts made, drafts asked)`` per drafting row."""
        for counts in (self.reached, self.ended):
            for j in counts:
                counts[j] *= self.decay
        for made, asked in rows:
            made = max(0, min(made, asked))
            # Positions 0 .. made where it ended short of k; 0 .. made - 1 where it got all
            # k: whether it would have ended at k was never seen (censored).
            ended = made < asked
            for j in range(made + 1 if ended else made):
                self.reached[j] = self.reached.get(j, 0.0) + 1.0
            if ended:
                self.ended[made] = self.ended.get(made, 0.0) + 1.0

    def hazard(self, j: int) -> float | None:
        """The share of rows at position ``j`` whose drafts ended there (None: no row got
        there)."""
        reached = self.reached.get(j, 0.0)
        return self.ended.get(j, 0.0) / reached if reached > 1e-12 else None

    def expected_drafts(self, k: int) -> float:
        """Drafts a row is expected to get when ``k`` are asked for (``k`` when nothing was
        seen: no stop known)."""
        return self.expected_drafts_upto(k)[k - 1] if k > 0 else 0.0

    def expected_drafts_upto(self, max_k: int) -> list[float]:
        """:meth:`expected_drafts` of k = 1 .. ``max_k``, in one pass."""
        out, total, alive, last = [], 0.0, 1.0, 0.0
        for j in range(max_k):
            h = self.hazard(j)
            last = last if h is None else h
            alive *= 1.0 - last  # P(L >= j + 1)
            total += alive
            out.append(min(float(j + 1), total))
        return out
