"""Which proposer drafts for a domain: the draft model or n-gram lookup, by measured goodput.

Prompt-lookup decoding (:func:`specdec.proposers.ngram_propose`) costs no model pass: on
repetitive text (code edits, answers quoting their documents) its drafts are accepted
often and a round is verification alone; on fresh prose it rarely matches, and the draft
model wins. Neither can be known in advance, so this policy measures it: per traffic
domain and batch-size bucket, the tokens a row committed per wall second of its rounds,
under each proposer, and gives the domain's rows the proposer that measured best.

"draft_model" here means the draft model *under the length policy*
(:class:`specdec.policy.SpeculationLength`), which already chooses k = 0 where drafting
does not pay: so the three choices of the field (draft model, n-gram, no speculation)
are compared, and each proposer's measured goodput includes its own overheads.

Each proposer is measured ``explore_rounds`` row-rounds before a choice is made; the one
not chosen is measured again for ``probe_rounds`` row-rounds every ``probe_every`` choices
in its (domain, bucket), and its new measurements replace the old (a stale figure would
keep a loser chosen, or a winner away). A challenger must measure ``min_gain`` better to
take over. Pure: the engine core's scheduler asks it and reports to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from specdec.policy import batch_bucket

Method = Literal["draft_model", "ngram"]
METHODS: tuple[Method, ...] = ("draft_model", "ngram")


@dataclass(frozen=True)
class ProposerChoiceConfig:
    """The settings of :class:`ProposerChoice` (row-rounds: one row's part of one round)."""

    explore_rounds: int = 12  # row-rounds measured per proposer before the first choice
    probe_every: int = 256  # choices in a (domain, bucket) between re-measurements
    probe_rounds: int = 12  # row-rounds one re-measurement of a proposer lasts
    min_gain: float = 0.05  # how much better a challenger must measure to take over
    decay: float = 0.9  # weight of the old value in the decayed tokens and seconds

    def __post_init__(self) -> None:
        if self.explore_rounds < 1 or self.probe_rounds < 1 or self.probe_every < 1:
            raise ValueError("explore_rounds, probe_rounds and probe_every must be >= 1")
        if not 0.0 <= self.decay < 1.0 or self.min_gain < 0:
            raise ValueError("need 0 <= decay < 1 and min_gain >= 0")


@dataclass
class _Arm:
    """One proposer's measurements in one (domain, bucket)."""

    tokens: float = 0.0  # decayed tokens committed per row-round [tokens]
    seconds: float = 0.0  # decayed wall seconds per row-round [s]
    count: int = 0  # row-rounds measured
    fresh: bool = False  # a re-measurement began: its first observation replaces the rest

    def rate(self) -> float | None:
        """Committed tokens per second of a row [tokens/s] (None: unmeasured)."""
        return self.tokens / self.seconds if self.count and self.seconds > 0 else None


@dataclass
class _Cell:
    """A (domain, bucket): its arms, the proposer it uses, and its probing clock."""

    arms: dict[str, _Arm] = field(default_factory=dict)
    current: str = "draft_model"
    choices: int = 0  # choices made since the last re-measurement cycle
    probing: str | None = None  # the proposer being re-measured
    probe_left: int = 0  # row-rounds of it still to run


class ProposerChoice:
    """Per domain and batch-size bucket, the proposer with the best measured goodput."""

    def __init__(self, config: ProposerChoiceConfig, methods: Sequence[Method] = METHODS):
        unknown = set(methods) - set(METHODS)
        if not methods or unknown:
            raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {methods}")
        self.config = config
        self.methods: tuple[str, ...] = tuple(m for m in METHODS if m in methods)
        self._cells: dict[tuple[str, int], _Cell] = {}

    def _cell(self, domain: str, batch_size: int) -> _Cell:
        key = (domain, batch_bucket(batch_size))
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = _Cell(current=self.methods[0])
        return cell

    def choose(self, domain: str, batch_size: int, available: Sequence[str] = METHODS) -> str:
        """The proposer for one row of ``domain`` in a round of ``batch_size`` rows;
        ``available``: those that can draft now (no draft model while it is replaced)."""
        usable = [m for m in self.methods if m in available]
        if not usable:
            return self.methods[0]
        cell = self._cell(domain, batch_size)
        for m in usable:  # the first exploration: every proposer measured
            arm = cell.arms.setdefault(m, _Arm())
            if arm.count < self.config.explore_rounds:
                return m
        if cell.probing in usable and cell.probe_left > 0:
            cell.probe_left -= 1
            return cell.probing
        cell.probing = None
        best = self._best(cell, usable)
        cell.choices += 1
        if cell.choices >= self.config.probe_every and len(usable) > 1:
            cell.choices = 0
            cell.probing = next(m for m in usable if m != best)
            cell.probe_left = self.config.probe_rounds - 1
            cell.arms[cell.probing].fresh = True
            return cell.probing
        return best

    def _best(self, cell: _Cell, usable: list[str]) -> str:
        """The current proposer, unless another measures ``min_gain`` better."""
        current = cell.current if cell.current in usable else usable[0]
        rate = cell.arms[current].rate() or 0.0
        for m in usable:
            other = cell.arms[m].rate() or 0.0
            if other > rate * (1.0 + self.config.min_gain):
                current, rate = m, other
        cell.current = current
        return current

    def observe(
        self, domain: str, batch_size: int, method: str, tokens: int, seconds: float
    ) -> None:
        """One row's round under ``method``: ``tokens`` committed in a round of ``seconds``
        wall time (the time every row of the round waited for it)."""
        if method not in self.methods or seconds <= 0:
            return
        arm = self._cell(domain, batch_size).arms.setdefault(method, _Arm())
        d = self.config.decay
        if arm.fresh or arm.count == 0:
            arm.tokens, arm.seconds, arm.fresh = float(tokens), seconds, False
        else:
            arm.tokens = d * arm.tokens + (1 - d) * tokens
            arm.seconds = d * arm.seconds + (1 - d) * seconds
        arm.count += 1

    def new_draft(self) -> None:
        """New draft weights: the draft model's goodput is unknown again everywhere."""
        for cell in self._cells.values():
            cell.arms.pop("draft_model", None)

    def state(self) -> dict[str, dict[str, dict]]:
        """Per domain, per bucket: the proposer in use and each one's measured goodput
        [tokens/s per row] (the engine core publishes it with the length policy's state;
        the monitor turns it into the proposer gauges)."""
        out: dict[str, dict[str, dict]] = {}
        for (domain, bucket), cell in self._cells.items():
            rates = {m: arm.rate() for m, arm in cell.arms.items()}
            out.setdefault(domain, {})[str(bucket)] = {"method": cell.current, "goodput": rates}
        return out
