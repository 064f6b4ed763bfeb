"""What the engine core's loop measures: per-phase round times, and round outcomes kept
for the monitor. Pure bookkeeping, no Ray and no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class RoundTimings:
    """Accumulated time per round phase, measured in the loop (for benchmarks and metrics).

    ``total_s`` runs from the moment a round starts gathering its drafts to the moment its
    outcomes are published; ``draft_wait_s`` is the part spent waiting for drafts (misses);
    ``verify_s`` the target's forward pass plus verification. Overhead is the rest: every
    bit of the critical path that is neither model work nor waiting for the draft.
    """

    rounds: int = 0
    total_s: float = 0.0
    draft_wait_s: float = 0.0
    verify_s: float = 0.0
    rows: int = 0  # sequence-rounds
    drafted_rows: int = 0  # sequence-rounds that carried drafts
    hits: int = 0  # ... whose drafts were prepared ahead (speculation-cache hits)
    draft_timeouts: int = 0
    paused: int = 0  # rows the length policy took out of the draft (k = 0)
    resumed: int = 0  # ... and sent to it again in full (drafting resumed)

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.draft_wait_s - self.verify_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overhead_s": self.overhead_s}


class Telemetry:
    """Round outcomes kept for the monitor until the frontend drains them (bounded: past
    ``max_rounds`` sequence-rounds the oldest are dropped and counted, so a monitor that
    stops draining cannot grow the core's memory)."""

    def __init__(self, max_rounds: int = 100_000):
        self.max_rounds = max_rounds
        self.drain()

    def add(self, outcomes, committed, verify_s: float, wait_s: float, total_s: float) -> None:
        """``outcomes``: (domain, drafted, accepted, cache hit) per drafted row;
        ``committed``: (domain, tokens) per row."""
        self.rounds.extend(outcomes)
        if len(self.rounds) > self.max_rounds:
            cut = len(self.rounds) - self.max_rounds
            del self.rounds[:cut]
            self.dropped += cut
        for domain, n in committed:
            self.committed[domain] = self.committed.get(domain, 0) + n
        if len(self.verify_s) < self.max_rounds:
            self.verify_s.append(verify_s)
            self.draft_wait_s.append(wait_s)
            self.overhead_s.append(max(0.0, total_s - verify_s - wait_s))

    def drain(self) -> dict[str, Any]:
        out = {
            k: getattr(self, k, None)
            for k in ("rounds", "committed", "verify_s", "draft_wait_s", "overhead_s", "dropped")
        }
        self.rounds, self.committed, self.dropped = [], {}, 0
        self.verify_s, self.draft_wait_s, self.overhead_s = [], [], []
        return out
