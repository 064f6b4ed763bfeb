"""The records a replica sends the monitor, and what the monitor answers.

The monitor is a Serve deployment of its own, updated apart from the replicas: during a
rolling update of either side, a record pickled by one version is read by the other. So
these are plain frozen dataclasses (no slots: unpickling restores their ``__dict__``), and
every field added after the first has a default, which an older sender's record falls
back to (a dataclass field's default is a class attribute); a field a newer sender adds
is ignored by an older reader's code. Never rename or retype a field; add one instead.
(The rule starts with this module: a replica from before it sends its alert cursor as a
tuple, which the monitor still reads, but cannot read a :class:`ReportReply`; until both
sides run this version, such a replica's flushes fail and are retried, and it gets no
drift alerts.)
``tests/monitoring/test_records.py`` holds that rule to account.

Imports nothing of the project (the monitor imports only ``specdec`` and itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoundRecord:
    """One sequence's verification round that carried drafts."""

    domain: str
    drafted: int  # draft tokens verified
    accepted: int  # of them accepted (a rejection happened iff accepted < drafted)
    cache_hit: bool = False  # the drafts were prepared while the previous round verified
    draft_version: int = 0  # the draft weights' version that drafted them (0: as deployed)
    # "draft_model" or "ngram" (lookup: no draft weights, so no drift of theirs to watch)
    proposer: str = "draft_model"


@dataclass(frozen=True)
class RoundBatch:
    """What a replica sends per flush: its rounds since the last one, and its state."""

    model: str
    replica: str
    rounds: Sequence[RoundRecord] = ()
    verify_s: Sequence[float] = ()  # per engine round
    draft_wait_s: Sequence[float] = ()
    overhead_s: Sequence[float] = ()
    committed: dict[str, int] = field(default_factory=dict)  # domain -> tokens committed
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # the target's KV slots in use / allocated
    kv_cache_token_usage: float = 0.0  # ... tokens held / slots x max_model_len
    # domain -> {"k", "alpha", "round_time_ratio": {k: T(k) / T(0)}}
    policy: dict[str, dict] = field(default_factory=dict)
    dropped: int = 0  # sequence-rounds the replica's buffer dropped since the last flush
    draft_version: int = 0  # the adapted draft version the replica serves (0: as deployed)
    # A split target's ranks as the replica's latest health poll saw them (empty: whole)
    ranks: tuple[RankRecord, ...] = ()


@dataclass(frozen=True)
class RankRecord:
    """One rank of a tensor-parallel target, as the replica's health poll last saw it."""

    rank: int  # its index in the group; 0 is the engine core
    up: bool  # it answered (a dead or hung rank fails the group at its next pass)
    calls: int = 0  # runner calls it has run (rank 0: calls broadcast to the group)


@dataclass(frozen=True)
class RequestRecord:
    """A finished request, for the GenAI server histograms."""

    model: str
    replica: str
    domain: str
    operation: str  # gen_ai.operation.name: "text_completion" or "chat"
    time_to_first_token_s: float | None
    duration_s: float
    output_tokens: int
    error_type: str | None = None


@dataclass(frozen=True)
class AlertCursor:
    """Where a replica is in the monitor's alert history (opaque to the replica)."""

    epoch: str  # the monitor's identity: a restarted monitor has a new one
    count: int  # alert changes seen so far


@dataclass(frozen=True)
class AlertRecord:
    """A drift alert's change for the replicas' length policies (a fire and a resolve
    both carry the latest estimate)."""

    domain: str
    current_alpha: float  # α̂ the detector estimates now


@dataclass(frozen=True)
class ReportReply:
    """The monitor's answer to a flush: alert changes since the replica's cursor."""

    alerts: list[AlertRecord]
    cursor: AlertCursor  # send it back with the next flush


@dataclass(frozen=True)
class AdaptationRecord:
    """One adaptation outcome, from the adaptation deployment (for metrics and the log)."""

    model: str
    outcome: str  # "started" | "deployed" | "rejected" | "failed" | "rolled_back" | "kept"
    domain: str
    version: int  # the version served after it (unchanged for started/rejected/failed)
    reason: str = ""
    gain: float | None = None  # validation: agreement gained on the domain
    training_tokens: int = 0  # output tokens trained on [tokens]
    training_s: float = 0.0  # wall seconds of the run [s]
