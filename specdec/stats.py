"""Speculation statistics: the one α̂ estimator, the additive counts every reader keeps, and
the record of one engine round, filled once by the core and read by everyone else.

One round's :class:`RoundStats` is what the length policy learns from (acceptance per
domain, the round's cost at its planned k), what the monitor receives (one
``monitoring.records.RoundRecord`` per drafted row), what the core's timings add up, and
where each request's :class:`SpecCounts` (the response's ``speculation`` block) comes
from. Nothing else counts drafted or accepted tokens.

Why α̂ = A / (A + R) and not accepted / drafted: with A accepted draft tokens and R rounds
that ended in a rejection, a round's accepted prefix is a geometric count censored at k,
and A / (A + R) is its maximum-likelihood estimate of the per-token acceptance α, whatever
k was; accepted / drafted is biased low (positions after a rejection are never tried) and
moves with k (docs/architecture.md, Formulas). The metrics export A and R so that PromQL
computes the same ratio::

    sum by (domain) (increase(specserve_spec_decode_num_accepted_tokens_total[5m]))
      / (sum by (domain) (increase(specserve_spec_decode_num_accepted_tokens_total[5m]))
         + sum by (domain) (increase(specserve_spec_decode_num_rejection_rounds_total[5m])))

Pure: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def alpha_hat(accepted: float, rejections: float) -> float | None:
    """α̂ = A / (A + R) from (possibly decayed) counts; None without evidence."""
    total = accepted + rejections
    return accepted / total if total > 0 else None


@dataclass(slots=True)
class SpecCounts:
    """Additive speculation counts: of one request, one domain, or everything.

    Filled only through :meth:`observe` (one drafted row of one round) and :meth:`add`.
    """

    drafted: int = 0  # draft tokens sent to verification [tokens]
    accepted: int = 0  # ... that the target kept (A) [tokens]
    rounds: int = 0  # rounds that carried drafts
    rejections: int = 0  # ... that ended in a rejection (R)
    cache_hits: int = 0  # ... whose drafts were prepared ahead (speculation-cache hits)
    # Of the above, what n-gram lookup drafted (the rest: the draft model).
    ngram_drafted: int = 0  # [tokens]
    ngram_accepted: int = 0  # [tokens]
    ngram_rounds: int = 0

    def observe(self, drafted: int, accepted: int, cache_hit: bool, ngram: bool = False) -> None:
        """One drafted row of one round (a row without drafts is not observed);
        ``ngram``: its drafts came from n-gram lookup, not the draft model."""
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += 1
        self.rejections += int(accepted < drafted)
        self.cache_hits += int(cache_hit)
        if ngram:
            self.ngram_drafted += drafted
            self.ngram_accepted += accepted
            self.ngram_rounds += 1

    def _fields(self) -> tuple[int, ...]:
        return (
            self.drafted,
            self.accepted,
            self.rounds,
            self.rejections,
            self.cache_hits,
            self.ngram_drafted,
            self.ngram_accepted,
            self.ngram_rounds,
        )

    def __reduce__(self):  # pickled as a tuple: it rides on every output message
        return SpecCounts, self._fields()

    def copy(self) -> SpecCounts:
        """A snapshot (for a message: the counts go on changing here)."""
        return SpecCounts(*self._fields())

    def add(self, other: SpecCounts) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rounds += other.rounds
        self.rejections += other.rejections
        self.cache_hits += other.cache_hits
        self.ngram_drafted += other.ngram_drafted
        self.ngram_accepted += other.ngram_accepted
        self.ngram_rounds += other.ngram_rounds

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (what clients are shown; alerts use :attr:`alpha_hat`)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per drafted round, counting the recovered or bonus token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass(slots=True)
class RowOutcome:
    """One row's part of one round (written once, when the round commits it)."""

    def __reduce__(self):  # pickled as a tuple, as every message is
        return RowOutcome, (
            self.domain,
            self.drafted,
            self.accepted,
            self.cache_hit,
            self.committed,
            self.asked_planned,
            self.draft_version,
            self.method,
            self.auto_method,
            self.k_asked,
        )

    domain: str  # the traffic domain (policy and telemetry key)
    drafted: int  # draft tokens verified [tokens]; 0: the row ran target-only
    accepted: int  # ... kept by the target [tokens]
    cache_hit: bool  # its drafts were prepared ahead of the round
    committed: int  # tokens the round appended to the row's output (after stops) [tokens]
    asked_planned: bool  # it asked for the round's planned k (its cost says something of it)
    draft_version: int = 0  # the draft weights' version that drafted it (0: as deployed)
    method: str = "draft_model"  # its proposer this round: "draft_model" or "ngram"
    auto_method: bool = False  # the proposer choice chose it (its goodput is measured)
    k_asked: int = 0  # drafts it asked for this round (its cap) [tokens]


@dataclass(slots=True)
class RoundStats:
    """One engine round, filled once by the core when the round ends; see the module
    docstring for who reads it. Times are wall seconds on the core's loop thread."""

    batch_size: int  # rows in the round
    planned_k: int  # the largest k asked: the k whose cost this round measures
    resuming: bool  # a row came back from a pause (its drafts began with a prefill)
    # every row's k came from the length policy (no request set its own, none was off)
    policy_rows: bool = False
    total_s: float = 0.0  # from gathering drafts to publishing outcomes [s]
    # from the end of the round before (admissions and prefills between included; the
    # round alone after the loop was idle) to this round's end [s]
    wall_s: float = 0.0
    prefill_s: float = 0.0  # of wall_s, the prefills of requests admitted before it [s]
    draft_wait_s: float = 0.0  # waiting for drafts (speculation-cache misses) [s]
    verify_s: float = 0.0  # the target's pass plus verification [s]
    draft_timeouts: int = 0  # rows that waited for drafts in vain
    # rows drafted by n-gram lookup: their verification is in the round's time, so it
    # says nothing clean of what the draft model's k costs, nor of drafting's goodput
    ngram_rows: int = 0
    rows: list[RowOutcome] = field(default_factory=list)  # rows that committed

    @property
    def overhead_s(self) -> float:
        """The critical path that is neither model work nor waiting for the draft [s]."""
        return max(0.0, self.total_s - self.draft_wait_s - self.verify_s)

    @property
    def decode_wall_s(self) -> float:
        """``wall_s`` less the admissions' prefills: what drafting and not drafting are
        compared by [s]. Each request is prefilled once whichever ran, but a burst of
        admissions lands in one round: at 64 concurrent requests on the demo pair, 16
        prompts prefilled together took 0.3-0.5 s, some 30 plain rounds, every 64 rounds,
        always in the rounds without drafts (the gate mostly closed), so a 12-round trial
        of drafting that missed it measured 25 % faster than not drafting by that alone."""
        return max(self.total_s, self.wall_s - self.prefill_s)

    @property
    def drafted_rows(self) -> list[RowOutcome]:
        return [r for r in self.rows if r.drafted]

    @property
    def committed(self) -> int:
        return sum(r.committed for r in self.rows)
