"""The engine core's scheduler: who waits, who runs, and how many drafts each row gets.

As vLLM v1 separates its ``Scheduler`` from the ``EngineCore`` that executes, this class
decides and the core acts: admission in arrival order while KV slots are free (never
more than ``max_num_seqs``), aborts, the draft length of every row each round (the
request's k or the length policy's choice, within max_tokens and both models' context),
when a row the policy keeps at k = 0 leaves the draft and when it comes back, and which
k a round measures for the policy's cost model. It holds no model, no actor and no
lock: the core's loop thread is its only caller, and the tests drive it alone.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import asdict, dataclass, field

from deployments.messages import DraftItem, DraftRestart, DriftAlert, EngineCoreRequest
from specdec.policy import SpeculationLength, batch_bucket
from specdec.proposer_choice import ProposerChoice
from specdec.sequence import SequenceState
from specdec.stats import RoundStats, SpecCounts

# A row the length policy keeps at k = 0 this many rounds in a row leaves the draft (no
# per-round messages, no branches); fewer, and it stays: resuming costs a full prefill.
PAUSE_AFTER_ROUNDS = 8


@dataclass
class RunningSeq:
    """A running sequence as the scheduler and the core's loop see it."""

    state: SequenceState
    k: int  # requested draft length (0: target-only)
    k_next: int = 0  # draft length asked of the draft for the next round
    guess: tuple[int, ...] = ()  # what the last round committed: the key of the next drafts
    synced: bool = False  # the draft has this sequence's tokens
    base_len: int = 0  # committed tokens before the last round's
    domain: str = "default"  # the traffic domain (policy and telemetry key)
    auto: bool = False  # k comes from the length policy, capped at ``k``
    zero_rounds: int = 0  # consecutive rounds the policy chose k = 0 for it
    # ... PAUSE_AFTER_ROUNDS of them, or never held while the gate is closed: the draft
    # was told to free it (idempotent)
    paused: bool = False
    resuming: bool = False  # sent in full after a pause: its next drafts start with a prefill
    counts: SpecCounts = field(default_factory=SpecCounts)  # its speculation so far
    # n-gram lookup: its k (0: never; a row drafted only by lookup has k = 0, so the
    # draft never hears of it), and whether the proposer choice picks between the two
    ngram_k: int = 0
    auto_method: bool = False
    method: str = "draft_model"  # its proposer unless the choice picks one
    method_next: str = "draft_model"  # the proposer of its next round
    ngram_next: int = 0  # n-gram drafts looked up for its next round (at most)
    output_kind: str = "delta"  # when its outputs go to the frontend (messages.OutputKind)

    @property
    def seq_id(self) -> Hashable:
        return self.state.seq_id


class Scheduler:
    """Admission, the running set and draft lengths; see the module docstring."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        draft_max_model_len: int,
        policy: SpeculationLength | None = None,
        choice: ProposerChoice | None = None,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.draft_max_model_len = draft_max_model_len
        self.policy = policy
        self.choice = choice  # the proposer per domain and batch size (None: each keeps its)
        self.draft_version = 0  # the newest draft weights' version seen in a round
        self.waiting: list[EngineCoreRequest] = []  # in arrival order
        self.running: dict[Hashable, RunningSeq] = {}
        self.has_draft = False  # a draft is connected (no draft: every k is 0)
        self.forced: int | None = None  # this round's cost-measurement k, if any
        self._forced_running: int | None = None  # ... of the round now running
        self._forced_before: int | None = None  # ... of the round before it
        self.dropped: list[Hashable] = []  # rows the draft must free (paused, given up)
        self.paused = 0  # rows the policy took out of (or kept from) the draft, and ...
        self._queued_planned = False  # requests waited when the next round was planned
        self._queued_running = False  # ... when the round now running was
        self._replanned = False  # admissions changed the next round's plan (admitted)
        self._replanned_running = False  # ... the plan of the round now running
        # The round now running was planned past speculation.disable_by_batch_size
        # (SpeculationLength.disabled): such rounds tell no policy.
        self._capped_running = False
        self.resumed = 0

    # ----- admission ------------------------------------------------------------------------

    def enqueue(self, items: list[EngineCoreRequest]) -> None:
        self.waiting.extend(items)

    def abort(self, seq_ids: set[Hashable]) -> list[Hashable]:
        """Drop aborted requests that still wait; returns the running ones to free."""
        if not seq_ids:
            return []
        self.waiting = [req for req in self.waiting if req.request_id not in seq_ids]
        return [sid for sid in seq_ids if sid in self.running]

    def admit(self, free_slots: int) -> list[EngineCoreRequest]:
        """The waiting items to start now: in order, as many as KV slots are free and
        max_num_seqs allows; the others keep waiting (a full cache queues, never fails)."""
        room = max(0, min(self.max_num_seqs - len(self.running), free_slots))
        batch, self.waiting = self.waiting[:room], self.waiting[room:]
        return batch

    def start(self, seq: RunningSeq) -> None:
        seq.auto = seq.auto and self.policy is not None
        self.running[seq.seq_id] = seq

    def admitted(self, started: Collection[Hashable]) -> None:
        """Sequences ``started`` (live: not finished at their prefill) join the round
        planned before them. Where that moves the batch to another bucket, a cost
        measurement planned for the old one is dropped; where it moves the batch to another
        bucket or queue state, the policy's choice for the round follows the batch it runs
        (SpeculationLength.admitted), and if that batch's gate is closed, the policy's
        rows planned before run the round at k = 0 too: verification is one pass padded to
        its longest row, and one row's 10 drafts made a round of 16 rows cost 45 ms against
        12. Their drafts, asked already, go unused; the draft keeps them (a pause comes
        after PAUSE_AFTER_ROUNDS as for any k = 0, so a batch moving between an open and a
        closed bucket re-sends nothing). Such a round tells the gate nothing."""
        if self.policy is None:
            return
        size = len(self.running)
        if self.forced is not None:
            same_bucket = batch_bucket(size) == self.policy.planned_bucket
            if same_bucket and not self.policy.disabled_by_batch_size(size):
                return  # a measurement of this bucket: it asks no gate
            self.forced = None
        if self.policy.admitted(size, queued=bool(self.waiting)):
            return  # the same bucket and queue state as planned
        self._queued_planned, self._replanned = bool(self.waiting), True
        if self.policy.gate_closed:
            new = set(started)
            for seq in self.running.values():
                if seq.auto and seq.k_next > 0 and seq.seq_id not in new:
                    seq.k_next = 0

    def finish(self, seq_id: Hashable) -> RunningSeq | None:
        return self.running.pop(seq_id, None)

    # ----- draft lengths ----------------------------------------------------------------------

    def next_round(self, seq: RunningSeq) -> DraftItem | None:
        """Choose the row's proposer and draft lengths for its next round; returns what
        the draft needs for it (None: nothing, e.g. a row drafted by n-gram lookup)."""
        seq.method_next = self._method_for(seq)
        seq.ngram_next = self._ngram_k_for(seq) if seq.method_next == "ngram" else 0
        if seq.k <= 0:
            seq.k_next = 0
            return None
        return self.draft_item(seq)

    def _method_for(self, seq: RunningSeq) -> str:
        """The row's proposer: its own, or the choice's for its domain and batch size (a
        cost measurement of the length policy runs every policy row on the draft model)."""
        if not seq.auto_method or self.choice is None:
            return seq.method
        if not self.has_draft or seq.k <= 0:  # no draft, or drafting gave up on this row
            return "ngram"
        if self.forced is not None or (self.policy is not None and self.policy.disabled):
            return "draft_model"  # (past disable_by_batch_size: at k = 0, no lookup either)
        return self.choice.choose(seq.domain, len(self.running))

    def _room(self, seq: RunningSeq, draft_context: bool) -> int:
        """Drafts the row can still take next round: within max_tokens and the target's
        context, and (``draft_context``) the draft model's (may be negative)."""
        st = seq.state
        length = len(st.prompt_token_ids) + len(st.output_token_ids)
        room = min(st.params.max_tokens - len(st.output_token_ids) - 1, self.max_model_len - length)
        return min(room, self.draft_max_model_len - length - 1) if draft_context else room

    def _ngram_k_for(self, seq: RunningSeq) -> int:
        """n-gram drafts for the next round: the row's k, within max_tokens and context."""
        return max(0, min(seq.ngram_k, self._room(seq, draft_context=False)))

    def k_for(self, seq: RunningSeq) -> int:
        """Draft length for the next round: the request's k or the policy's choice, never
        past max_tokens or either model's context (0 in a round of n-gram drafts)."""
        if not self.has_draft or seq.k <= 0 or seq.method_next == "ngram":
            return 0
        k = seq.k
        if seq.auto:
            k = min(k, self.policy.choose(seq.domain, len(self.running), forced=self.forced))
        return max(0, min(k, self._room(seq, draft_context=True)))

    def draft_item(self, seq: RunningSeq) -> DraftItem | None:
        """What the draft needs for the sequence's next round, or None once the length
        policy has kept it at k = 0 for PAUSE_AFTER_ROUNDS rounds: then the draft forgets
        the sequence (no message per round, no branches held: idle drafting only competes
        with verification and the frontend for the cores; it is added to :attr:`dropped`)
        and gets it back in full when the policy drafts for it again. A row the draft does
        not hold (just admitted) is not sent while the gate is closed: its prefill there
        would be for nothing. (A held row keeps the PAUSE_AFTER_ROUNDS hysteresis: a batch
        size moving between buckets, one closed and one open, would otherwise re-send
        every row in full each time.) Cost measurements and the gate's measurements at
        k = 0 do not count towards a pause."""
        seq.k_next = self.k_for(seq)
        st = seq.state
        if seq.k_next > 0 or not seq.auto:
            seq.zero_rounds = 0
        elif self.forced is None and not self.policy.measuring_off:
            seq.zero_rounds += 1
        if (
            seq.k_next == 0
            and seq.auto  # (so the policy exists)
            and (
                seq.paused
                or seq.zero_rounds >= PAUSE_AFTER_ROUNDS
                or (self.policy.gate_closed and not seq.synced)
            )
        ):
            if not seq.paused:  # (freeing is idempotent: also when synced was lost)
                seq.paused, seq.synced = True, False
                self.dropped.append(st.seq_id)
                self.paused += 1
            return None
        if seq.paused:
            seq.paused, seq.resuming = False, True
            self.resumed += 1
        if seq.synced:
            return DraftItem(st.seq_id, seq.base_len, list(seq.guess), seq.k_next)
        seq.synced = True
        restart = DraftRestart(
            list(st.prompt_token_ids), list(st.output_token_ids), asdict(st.params)
        )
        return DraftItem(st.seq_id, 0, list(seq.guess), seq.k_next, restart)

    def full_items(self) -> list[DraftItem]:
        """Every drafted sequence in full, for a draft that knows none of them."""
        for seq in self.running.values():
            seq.synced = False
        items = [self.draft_item(seq) for seq in self.running.values() if seq.k > 0]
        return [item for item in items if item is not None]

    def unsync_all(self) -> None:
        """The draft is gone: whichever comes next gets every sequence in full."""
        for seq in self.running.values():
            seq.synced = False

    def give_up(self, seq: RunningSeq) -> None:
        """Drafting failed for this row alone: target-only from now on (and the draft,
        which may have taken it back since, is told to free it: freeing is idempotent)."""
        seq.k = seq.k_next = 0
        self.dropped.append(seq.seq_id)

    def take_dropped(self) -> list[Hashable]:
        dropped, self.dropped = self.dropped, []
        return dropped

    # ----- the length policy --------------------------------------------------------------------

    def take_drift_alerts(self, alerts: list[DriftAlert]) -> None:
        """Hand alerts to the policy (before any k is chosen: a sequence admitted right
        after an alert already drafts at the k the alert implies)."""
        if self.policy is not None:
            for alert in alerts:
                self.policy.on_drift(alert.domain, alert.current_alpha)

    def new_draft(self, version: int) -> None:
        """Draft weights ``version`` serve (told by the frontend, or seen in a round's
        drafts): if newer, acceptance is learnt again (SpeculationLength.new_draft), so a
        domain the old draft lost speculation on drafts again at once, and the draft
        model's goodput against n-gram lookup is measured again."""
        if version > self.draft_version:
            self.draft_version = version
            if self.policy is not None:
                self.policy.new_draft()
            if self.choice is not None:
                self.choice.new_draft()

    @property
    def measuring_running_round(self) -> bool:
        """The round now running (just verified, once plan_round ran) is the length
        policy's cost measurement at a forced k, or the first after one (its drafts were
        prepared at that k)."""
        return self._forced_running is not None or self._forced_before is not None

    def plan_round(self, batch_size: int, alerts: list[DriftAlert]) -> None:
        """Before the next round's draft lengths are chosen: drift alerts that came in,
        and whether the next round measures the cost of one k (see SpeculationLength)."""
        if self.policy is None:
            return
        self.take_drift_alerts(alerts)
        domains = {seq.domain for seq in self.running.values() if seq.auto}
        # The k of the round now running were chosen under the plan before this one.
        self._forced_before = self._forced_running
        self._forced_running = self.forced
        self._queued_running, self._queued_planned = self._queued_planned, bool(self.waiting)
        self._replanned_running, self._replanned = self._replanned, False
        self._capped_running = self.policy.disabled
        self.forced = self.policy.plan_round(batch_size, domains, queued=self._queued_planned)

    def observe_round(self, stats: RoundStats) -> None:
        """A round ended: acceptance per domain, and (unless rows resumed, whose drafts
        began with a prefill) what a round of its batch size at its planned k cost and
        delivered, from the rows that asked for the planned k (rows asking fewer say
        nothing of it)."""
        self._observe_proposers(stats)
        if self.policy is None:
            return
        model_rows = [row for row in stats.drafted_rows if row.method == "draft_model"]
        self.new_draft(max((row.draft_version for row in model_rows), default=0))
        current = [row for row in model_rows if row.draft_version == self.draft_version]
        for row in current:  # (drafts of the old weights: stale)
            self.policy.observe_round(row.domain, row.drafted, row.accepted)
        # Every row that got drafts, at its own cap (a draft that timed out drafted none).
        # A hit's drafts were prepared at the k of the round before, which may be shorter
        # than asked now: its drafts say nothing past their count.
        self.policy.observe_positions(
            stats.batch_size,
            [
                (row.domain, row.drafted if row.cache_hit else row.k_asked, row.accepted)
                for row in current
            ],
        )
        # Past disable_by_batch_size the policy's rows ran at k = 0 by the operator's word:
        # neither costs nor the gate's figures (requests' own k still tell acceptance).
        if self._capped_running:
            return
        # A round with lookup rows says nothing clean of the draft model's costs, unless it
        # is a cost measurement (then only requests that named n-gram lookup are on it,
        # and a request that keeps naming it must not starve the bucket of measurements).
        if not stats.resuming and (not stats.ngram_rows or self._forced_running is not None):
            at_planned = [
                (row.domain, row.drafted, row.accepted) for row in stats.rows if row.asked_planned
            ]
            self.policy.observe_round_time(
                stats.batch_size, stats.planned_k, stats.total_s, at_planned
            )
            # A cost measurement says nothing of goodput, nor does a round whose lengths
            # were partly someone else's (a request's own k, speculation off, a seed) or
            # partly another plan's (admissions re-decided it).
            if self._forced_running is None and stats.policy_rows and not self._replanned_running:
                self.policy.observe_round_wall(
                    stats.batch_size,
                    stats.planned_k > 0,
                    stats.committed,
                    stats.decode_wall_s,
                    queued=self._queued_running,  # the state its plan was made in
                )

    def _observe_proposers(self, stats: RoundStats) -> None:
        """What each row the proposer choice placed committed in the round's wall time
        (not in the length policy's cost measurements: they ran at a forced k)."""
        if self.choice is None or self._forced_running is not None or self._capped_running:
            return
        for row in stats.rows:
            if row.auto_method:
                self.choice.observe(
                    row.domain, stats.batch_size, row.method, row.committed, stats.decode_wall_s
                )
