"""Speculation policies: pure decisions the draft and the engine core consult each round.

:class:`SpeculationWidth` decides how many outcomes the draft prepares per round while
the target verifies. Branches are free only while they finish before verification does:
branches still being drafted when the outcome arrives are dropped, and on a 2-core machine
drafting during verification also slows the target. So the width follows what happened:
it grows while speculation finishes with time to spare, shrinks when it was cut short, and
speculation pauses (re-probed now and then) when the hit rate is too low to pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationWidth:
    """Branches per sequence to prepare next round (additive increase, cut on overrun)."""

    max_width: int
    adaptive: bool = True
    min_hit_rate: float = 0.15  # below this (moving average), speculation pauses
    probe_every: int = 32  # while paused, speculate once every this many rounds
    slack: float = 0.6  # grow only if speculation took under this share of verification
    decay: float = 0.9
    width: int = 0
    hit_rate: float = 0.5
    _paused_rounds: int = 0

    def __post_init__(self) -> None:
        self.width = self.max_width

    def budget(self, num_seqs: int) -> int:
        """Branches to prepare this round across ``num_seqs`` sequences (0: none)."""
        if self.max_width <= 0 or num_seqs <= 0:
            return 0
        if not self.adaptive:
            return self.max_width * num_seqs
        if self.hit_rate < self.min_hit_rate:
            self._paused_rounds += 1
            if self._paused_rounds % self.probe_every:
                return 0
        return self.width * num_seqs

    def observe_speculation(self, elapsed_s: float, verify_s: float | None, cut: bool) -> None:
        """How the last speculation went: its time, the verify time, whether it was cut."""
        if not self.adaptive:
            return
        if cut:
            self.width = max(1, self.width - 1)
        elif verify_s is not None and elapsed_s < self.slack * verify_s:
            self.width = min(self.max_width, self.width + 1)

    def observe_hits(self, hits: int, rows: int) -> None:
        """How many of ``rows`` drafted rows were served from prepared branches."""
        if rows:
            self.hit_rate = self.decay * self.hit_rate + (1 - self.decay) * hits / rows
            if self.hit_rate >= self.min_hit_rate:
                self._paused_rounds = 0
