"""What the engine core's loop keeps of its rounds: accumulated phase times (for benchmarks
and /health), and round outcomes held for the monitor. Both are filled from the one
:class:`specdec.stats.RoundStats` each round produces. Pure bookkeeping, no Ray, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdec.stats import RoundStats, RowOutcome


@dataclass
class RoundTimings:
    """Accumulated time per round phase (for benchmarks and metrics).

    ``total_s`` runs from the moment a round starts gathering its drafts to the moment its
    outcomes are published; ``draft_wait_s`` is the part spent waiting for drafts (misses);
    ``verify_s`` the target's forward pass plus verification. Overhead is the rest: every
    bit of the critical path that is neither model work nor waiting for the draft.
    ``wall_s`` runs from one round's end to the next's (idle time excluded): what a round
    costs the loop, the time between rounds (admissions, the loop thread's wait for the
    interpreter) included; ``prefill_s`` the part of it spent prefilling admitted requests.
    """

    rounds: int = 0
    total_s: float = 0.0
    draft_wait_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0  # the sum of each round's RoundStats.overhead_s
    wall_s: float = 0.0  # the sum of each round's RoundStats.wall_s
    prefill_s: float = 0.0  # ... of which admissions' prefills (RoundStats.prefill_s)
    rows: int = 0  # sequence-rounds
    drafted_rows: int = 0  # sequence-rounds that carried drafts
    hits: int = 0  # ... whose drafts were prepared ahead (speculation-cache hits)
    draft_timeouts: int = 0
    paused: int = 0  # rows the length policy took out of (or kept from) the draft (k = 0)
    resumed: int = 0  # ... and sent to it again in full (drafting resumed)
    by_planned_k: dict[int, int] = field(default_factory=dict)  # k -> rounds planned at it
    # k -> tokens committed and critical-path seconds (total_s) of those rounds: the
    # goodput each k really gave, against which the length policy's predictions are read
    tokens_by_planned_k: dict[int, int] = field(default_factory=dict)
    seconds_by_planned_k: dict[int, float] = field(default_factory=dict)

    def add(self, stats: RoundStats) -> None:
        self.rounds += 1
        k = stats.planned_k
        self.by_planned_k[k] = self.by_planned_k.get(k, 0) + 1
        self.tokens_by_planned_k[k] = self.tokens_by_planned_k.get(k, 0) + stats.committed
        self.seconds_by_planned_k[k] = self.seconds_by_planned_k.get(k, 0.0) + stats.total_s
        self.rows += stats.batch_size
        self.drafted_rows += len(stats.drafted_rows)
        self.hits += sum(row.cache_hit for row in stats.rows)
        self.draft_timeouts += stats.draft_timeouts
        self.draft_wait_s += stats.draft_wait_s
        self.verify_s += stats.verify_s
        self.total_s += stats.total_s
        self.overhead_s += stats.overhead_s
        self.wall_s += stats.wall_s
        self.prefill_s += stats.prefill_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Telemetry:
    """Round outcomes kept for the monitor until the frontend drains them (bounded: past
    ``max_rounds`` sequence-rounds the oldest are dropped and counted, so a monitor that
    stops draining cannot grow the core's memory)."""

    def __init__(self, max_rounds: int = 100_000):
        self.max_rounds = max_rounds
        self.drain()

    def add(self, stats: RoundStats) -> None:
        self.rounds.extend(stats.drafted_rows)
        if len(self.rounds) > self.max_rounds:
            cut = len(self.rounds) - self.max_rounds
            del self.rounds[:cut]
            self.dropped += cut
        for row in stats.rows:
            self.committed[row.domain] = self.committed.get(row.domain, 0) + row.committed
        if len(self.verify_s) < self.max_rounds:
            self.verify_s.append(stats.verify_s)
            self.draft_wait_s.append(stats.draft_wait_s)
            self.overhead_s.append(stats.overhead_s)

    def drain(self) -> dict[str, Any]:
        """What was kept since the last call (the fields of a TelemetrySnapshot)."""
        out = {
            k: getattr(self, k, None)
            for k in ("rounds", "committed", "verify_s", "draft_wait_s", "overhead_s", "dropped")
        }
        self.rounds: list[RowOutcome] = []
        self.committed: dict[str, int] = {}
        self.dropped = 0
        self.verify_s: list[float] = []
        self.draft_wait_s: list[float] = []
        self.overhead_s: list[float] = []
        return out
