"""Speculation policies: pure decisions the draft and the engine core consult each round.

:class:`SpeculationLength` (the engine core) chooses the draft length k per domain and
batch size from measured acceptance and round costs (below).

:class:`SpeculationWidth` decides how many outcomes the draft prepares per round while
the target verifies. Branches are free only while they finish before verification does:
branches still being drafted when the outcome arrives are dropped, and where draft and
target share a machine (two processes on a 2-core host, or one GPU) drafting during
verification also slows the target. So nothing here is assumed, it is measured:

* the width, per batch-size bucket, grows while speculation finishes with time to spare
  and shrinks when the outcome cut it short (for one sequence only when nothing was
  kept); speculation pauses (re-probed now and then) while its hit rate is too low;
* whether speculating while verifying pays at all is decided by goodput: per batch-size
  bucket, committed tokens per second of rounds with and without it, measured in turns
  of a few rounds each (so both see the same minutes), again every ``compare_every``
  rounds; speculating must be ``min_gain`` faster to be kept. Without it
  the pipeline is the sequential one (fresh drafts after each outcome), so overlap mode
  is never slower than sequential mode for long.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from specdec.speculation_gate import GateConfig, SpeculationGate, batch_bucket
from specdec.speedup import expected_tokens_per_round
from specdec.stats import alpha_hat


@dataclass
class _Bucket:
    """Goodput bookkeeping of one batch-size bucket."""

    rounds: int = 0  # rounds observed
    rates: dict[bool, float] = field(default_factory=dict)  # speculating? -> tokens/s
    choice: bool | None = None  # the choice of the rounds now running
    measuring: bool = False  # both choices run in turns, block by block
    block_left: int = 0  # rounds of the current block still to observe
    next_compare: int = 0  # round at which both choices are measured again
    starts: bool = True  # the choice the next measurement starts with (they alternate)
    # speculating? -> [tokens, seconds, rounds] of the measurement under way
    sums: dict[bool, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class WidthPolicyConfig:
    """The settings of :class:`SpeculationWidth`."""

    max_width: int  # branches per sequence at most (0: never speculate while verifying)
    adaptive: bool = True  # False: always max_width branches, nothing measured
    min_hit_rate: float = 0.15  # below this (moving average), speculation pauses
    probe_every: int = 32  # while paused, speculate once every this many rounds
    slack: float = 0.6  # grow only if speculation took under this share of verification
    decay: float = 0.9  # per observed round, of the hit rate's moving average
    compare_every: int = 256  # rounds between two measurements of both choices
    # Rounds counted per choice in one measurement. At batch 1 a round commits 1 to k + 1
    # tokens: 5 rounds of one choice, then 5 of the other, decided the next 256 rounds on
    # noise and on what the minutes they ran in were like (the first after startup slow).
    compare_rounds: int = 12
    block: int = 4  # rounds per turn of a measurement (its first is not counted)
    # Speculating must measure this much faster (0.1: 10 %) to be kept: its cost to the
    # rest of the host (the frontend's cores, not on the core's critical path) is not in
    # the rounds measured. Without it, 64 concurrent requests ran at 0.79x speculation
    # off (bench.policy --shipped), where rounds measured it as paying.
    min_gain: float = 0.1
    # One sequence speculates at the width without measuring: its few branches run on
    # the draft's own device, idle otherwise, and cost the rest of the host little, while
    # one measurement of its rounds (1 to k + 1 tokens each) moves by ~17 % and kept
    # speculation off in some runs. In turns over 32 held-out prompts, always speculating
    # ran at 1.11x the measured choice at batch 1 (bench.length_policy, demo.yaml).
    measure_from: int = 2
    # Branches per sequence a bucket of measure_from sequences or more starts at, widened
    # by one while speculation finishes early (one sequence starts at max_width). Started
    # at max_width, 16 rows drafted 8 branches each in every round that drafted: the
    # draft then used 1.3-1.4 s of a core per 5 s wave at 64 concurrent requests (in the
    # few rounds the gate let draft), on the core that also serves HTTP.
    start_width: int = 1


class SpeculationWidth:
    """Branches per sequence to prepare next round, or none where measured goodput says
    speculating during verification does not pay.

    The width is kept per batch bucket (additive increase while speculation finishes
    early, one less when the outcome arrives before it finished: see
    :meth:`observe_speculation` for one sequence): the time a round's
    verification leaves the draft, and what one more branch per sequence costs, both grow
    with the batch. One width for all batches was grown by single sequences and spent, at
    16 sequences, 8 branches each on drafts that no verification waited long enough for
    (bench.policy --shipped at 32 and 64 concurrent: 0.92x off).

    Goodput with and without speculating is measured in turns of ``block`` rounds until
    each has ``compare_rounds`` rounds, so that both see the same minutes, text and load;
    the better runs until the next measurement ``compare_every`` rounds on. A round is
    counted for a choice only if the two :meth:`budget` calls before it both did what the
    choice says (branches prepared or not): the one before last prepared the drafts it
    waited for, the last one's branches ran beside its verification."""

    def __init__(self, config: WidthPolicyConfig):
        self.config = config
        self.max_width, self.adaptive = config.max_width, config.adaptive
        self.min_hit_rate, self.probe_every = config.min_hit_rate, config.probe_every
        self.slack, self.decay = config.slack, config.decay
        self.compare_every, self.compare_rounds = config.compare_every, config.compare_rounds
        self.block = max(2, config.block)
        # branches per sequence of a bucket not yet narrowed or grown (one sequence: max)
        self._start_width = max(1, min(self.max_width, config.start_width))
        self._widths: dict[int, int] = {}  # batch bucket -> branches per sequence
        self._width_seqs = 1  # sequences of the last budget() (its speculation's)
        self.hit_rate = 0.5  # moving average of the share of drafted rows served by a branch
        self._paused_rounds = 0
        self._buckets: dict[int, _Bucket] = {}
        self._last: _Bucket | None = None  # the bucket of the round now running
        # whether the last two new-round budget calls prepared branches (oldest first)
        self._prepared: tuple[bool | None, bool | None] = (None, None)

    def budget(self, num_seqs: int, new_round: bool = True) -> int:
        """Branches to prepare this round across ``num_seqs`` sequences (0: none; call it
        with 0 for a round with nothing to prepare, so that the round after is not
        charged to speculating).

        ``new_round`` False: a call between rounds (sequences just admitted) that follows
        the current choice without being counted as the round the next goodput belongs to.
        """
        n = self._budget(num_seqs, new_round)
        if new_round:
            self._prepared = (self._prepared[1], n > 0)
        return n

    def _budget(self, num_seqs: int, new_round: bool) -> int:
        if self.max_width <= 0 or num_seqs <= 0:
            return 0
        self._width_seqs = num_seqs
        if not self.adaptive:
            return self.max_width * num_seqs
        if num_seqs < self.config.measure_from:
            self._last = None  # not measured: its rounds judge no bucket's choice
            speculate = True
        elif new_round:
            speculate = self.should_speculate(num_seqs)
        else:
            speculate = self._last is None or bool(self._last.choice)
        if not speculate:
            return 0
        measuring = self._last is not None and self._last.measuring
        if self.hit_rate < self.min_hit_rate and not measuring:  # (a measurement measures)
            self._paused_rounds += 1
            if self._paused_rounds % self.probe_every:
                return 0
        return self.width * num_seqs

    @property
    def width(self) -> int:
        """Branches per sequence at the batch bucket of the last :meth:`budget` call."""
        start = self.max_width
        if self._width_seqs >= self.config.measure_from:
            start = self._start_width
        return self._widths.get(batch_bucket(self._width_seqs), start)

    def widths(self) -> dict[int, int]:
        """Branches per sequence per batch bucket narrowed or grown so far (for stats;
        a bucket not listed is at its start: ``max_width`` for one sequence, else
        ``start_width``)."""
        return dict(sorted(self._widths.items()))  # (sorted copies the items in one step)

    def should_speculate(self, num_seqs: int) -> bool:
        """Measure both choices in turns, then take the better one until the next
        measurement (conditions change: load, batch mix, a new draft)."""
        b = self._buckets.setdefault(batch_bucket(num_seqs), _Bucket())
        self._last = b
        if not b.measuring and (not b.rates or b.rounds >= b.next_compare):
            b.measuring, b.sums = True, {True: [0.0, 0.0, 0], False: [0.0, 0.0, 0]}
            self._switch(b, b.starts)
            b.starts = not b.starts
        elif b.measuring and b.block_left <= 0:
            if min(n for _, _, n in b.sums.values()) >= self.compare_rounds:
                b.rates = {c: t / s for c, (t, s, _) in b.sums.items() if s > 0}
                b.measuring = False
                b.next_compare = b.rounds + self.compare_every
                on, off = b.rates.get(True, 0.0), b.rates.get(False, 0.0)
                self._switch(b, on >= (1.0 + self.config.min_gain) * off)
            else:
                self._switch(b, not b.choice)
        return bool(b.choice)

    def _switch(self, b: _Bucket, choice: bool) -> None:
        b.block_left = self.block
        b.choice = choice

    def observe_round(self, tokens: int, seconds: float, elsewhere: bool = False) -> None:
        """The round that ran under the last :meth:`budget` committed ``tokens`` in
        ``seconds`` (wall time of the round in the engine core). ``elsewhere``: its k was
        decided for another purpose (the length policy's cost measurement at a forced k,
        or the gate's at k = 0), nothing was drafted, or rows resumed drafting (their draft
        prefilled first), so its goodput is not the width choice's: not counted. Counted,
        such rounds (both policies start measuring at once) made speculating look like 280
        tokens/s against 500 off at batch 1, and in another run not speculating like 210
        against 630."""
        b = self._last
        if not self.adaptive or b is None or b.choice is None or seconds <= 0 or elsewhere:
            return
        b.rounds += 1
        if not b.measuring:
            return
        b.block_left -= 1
        if self._prepared != (b.choice, b.choice):  # its drafts or its verification ran
            return  # under the other choice (a new turn, a pause, another batch size)
        sums = b.sums[b.choice]
        sums[0] += tokens
        sums[1] += seconds
        sums[2] += 1

    def goodput(self) -> dict[int, dict[str, float]]:
        """Measured tokens/s per batch bucket, with and without speculation (for stats).
        Read from another thread than the loop's, which adds buckets: over copies (one
        ``list`` of a dict is one step under the GIL; iterating the dict itself raised
        when a bucket was added meanwhile)."""
        return {
            bucket: {("on" if c else "off"): round(r, 2) for c, r in list(b.rates.items())}
            for bucket, b in list(self._buckets.items())
        }

    def observe_speculation(
        self, elapsed_s: float, verify_s: float | None, cut: bool, stopped: bool = False
    ) -> None:
        """How the speculation of the last :meth:`budget` went: its time, the verify time,
        whether the outcome cut it short with nothing kept (``cut``) or with the greedy
        branches' drafts so far kept (``stopped``).

        A stop narrows only batches of ``measure_from`` sequences or more: there the
        drafts no verification waited for cost the rest of the host; one sequence's few
        branches run on the draft's own device, idle otherwise, and the hit among them is
        served with what it has (counted as cuts, single sequences ran at 4.7 branches a
        round for 6.8 and hit 46 % for 52 % of rounds in process, demo.yaml)."""
        if not self.adaptive:
            return
        width, bucket = self.width, batch_bucket(self._width_seqs)
        if cut or (stopped and self._width_seqs >= self.config.measure_from):
            self._widths[bucket] = max(1, width - 1)
        elif not stopped and verify_s is not None and elapsed_s < self.slack * verify_s:
            self._widths[bucket] = min(self.max_width, width + 1)

    def observe_hits(self, hits: int, rows: int) -> None:
        """How many of ``rows`` drafted rows were served from prepared branches."""
        if rows:
            self.hit_rate = self.decay * self.hit_rate + (1 - self.decay) * hits / rows
            if self.hit_rate >= self.min_hit_rate:
                self._paused_rounds = 0


@dataclass
class _Domain:
    """Decayed acceptance counts of one traffic domain, and its probing state."""

    accepted: float = 0.0  # A: accepted draft tokens
    rejections: float = 0.0  # R: rounds that ended in a rejection
    disabled_at: int | None = None  # the engine round when k = 0 was chosen
    probe_until: int = 0  # its rows run at probe_k until this engine round
    k: int | None = None  # the last choice (for the gauges)
    batch_size: int = 1  # of the last round it was asked about (its costs' bucket)

    @property
    def tokens(self) -> float:
        return self.accepted + self.rejections

    def alpha(self) -> float | None:
        return alpha_hat(self.accepted, self.rejections)


@dataclass
class _Costs:
    """Measured critical-path round time of one batch-size bucket, per draft length."""

    seconds: dict[int, float] = field(default_factory=dict)  # k -> decayed mean round time
    # k -> decayed mean of the drafts a drafted row really got in rounds planned at k: a
    # draft that stops where it is unsure (draft_confidence_threshold) or a draft that
    # timed out gives fewer than k, and E(α, k) must count the drafts that were made.
    drafted: dict[int, float] = field(default_factory=dict)
    # k -> decayed ratio of the tokens those rows committed to what E(α̂ of each row's
    # domain, the mean drafts) predicted: below 1 where the formula is optimistic (rows
    # stop at different lengths and E is concave in them). Pooled over domains, it only
    # ever scales E down (a confident domain must not make a weak one draft long).
    ratio: dict[int, float] = field(default_factory=dict)
    # domain -> k -> the same ratio of that domain's rows alone: it scales the domain's E
    # either way, up where the formula is pessimistic (a draft with a confidence stop
    # proposes the tokens it is sure of, which the target accepts more often than α̂ says).
    domain_ratio: dict[str, dict[int, float]] = field(default_factory=dict)
    # domain -> [draft position m] -> decayed counts of rows that reached position m (their
    # first m - 1 drafts accepted, the round asked for m or more) and of those whose m-th
    # draft was made and accepted: the chance a row gets past each position, whatever k
    # it asked for, from every round (a row capped at k says nothing of positions past
    # k: a Kaplan-Meier estimate, censored there). A row commits 1 + sum over m <= k of
    # the chance of getting past 1..m at k (``SpeculationLength.survival_tokens``). Per-k
    # means of E x ratio, each from its own few rounds, chose short k on noise
    # (bench.length_policy at batch 1: k = 3 in 152 rounds that gave 406 tokens/s, while
    # k = 11-12 gave 570-588).
    reached: dict[str, list[float]] = field(default_factory=dict)
    passed: dict[str, list[float]] = field(default_factory=dict)
    # (what, k[, domain]) -> observations in that running mean since it was (re)started
    samples: dict[tuple, int] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)  # k -> rounds measured
    last: dict[int, int] = field(default_factory=dict)  # k -> round of its last measurement
    tries: dict[int, int] = field(default_factory=dict)  # k -> rounds forced to measure it
    tries_at: dict[int, int] = field(default_factory=dict)  # k -> round of its last forcing
    rounds: int = 0  # rounds planned in this bucket that could use its costs: their age
    forced: int | None = None  # the k a measurement runs at
    forced_left: int = 0
    # Rounds between re-measurements: doubles while the bucket's choice stays k = 0 (a
    # forced k > 0 round there costs a resumed draft and a slow round for nothing new),
    # back to ``remeasure_every`` once a k > 0 is chosen in it.
    remeasure_every: int = 0
    chose_k: bool = False  # some choice in this bucket was k > 0 since the last cycle began
    remeasures: int = 0  # re-measurement cycles started (after the first exploration)
    # Lengths being re-measured: their next observation replaces what was known (a decayed
    # mean would keep most of a stale or cold-start estimate after a few rounds).
    fresh: set[int] = field(default_factory=set)

    def update(self, by_k: dict[int, float], key: tuple, k: int, value: float, decay: float):
        """Fold ``value`` into ``by_k[k]``: the plain mean of the observations while they
        are fewer than the decayed mean's memory, then the decayed mean (so the first
        round after a (re)start is one of n, not most of the estimate)."""
        n = self.samples.get(key, 0) if k in by_k else 0
        w = min(decay, n / (n + 1))
        by_k[k] = value if n == 0 else w * by_k[k] + (1 - w) * value
        self.samples[key] = n + 1

    def has_k(self) -> bool:
        """Whether some k > 0 has a measured round time (else no k can be predicted)."""
        return any(k > 0 for k in self.seconds)

    def forget(self, k: int) -> None:
        """Drop what is known at ``k`` (a re-measurement replaces it; the survival counts
        stay: every round keeps those of the positions it reached current)."""
        for by_k in (self.seconds, self.drafted, self.ratio, *self.domain_ratio.values()):
            by_k.pop(k, None)

    def forget_ratios(self, domain: str | None = None) -> None:
        """Drop the ratios to E and the position counts of ``domain`` (None: every one,
        pooled ratios too)."""
        if domain is None:
            self.ratio.clear()
            self.domain_ratio.clear()
            self.reached.clear()
            self.passed.clear()
        else:
            self.domain_ratio.pop(domain, None)
            self.reached.pop(domain, None)
            self.passed.pop(domain, None)


@dataclass(frozen=True)
class LengthPolicyConfig:
    """The settings of :class:`SpeculationLength` (rounds: engine rounds; k: drafts per
    row per round)."""

    max_k: int  # the longest draft length chosen [tokens]
    default_k: int | None = None  # k until measurements decide (None: max_k) [tokens]
    decay: float = 0.98  # per observed round, of a domain's counts A and R
    min_tokens: float = 24.0  # A + R a domain needs before its α̂ is used
    # Weight of the old value in the per-k decayed measurements: ~20 rounds of memory. At
    # batch 1 one round commits anywhere from 1 to k + 1 tokens; with 5 rounds (0.8) the
    # argmax over k followed that noise (bench.length_policy: 1.10x left to fixed k = 12,
    # 1.07x at 0.95). A change of conditions is caught by the re-measurements, which
    # replace the old values rather than average with them.
    cost_decay: float = 0.95
    explore_rounds: int = 3  # rounds measured at each anchor k before the costs are used
    # Rounds of a bucket that could use its costs (SpeculationLength._ages_costs) between
    # re-measurements of the anchors.
    remeasure_every: int = 256
    probe_every: int = 128  # rounds between re-probes of a domain at k = 0
    probe_rounds: int = 4  # rounds one re-probe lasts
    probe_k: int = 1  # the k a re-probe runs at (kept within [1, max(1, max_k)]) [tokens]
    min_gain: float = 0.1  # predicted goodput gain over k = 0 a k > 0 must show (0.1: 10 %)
    max_remeasure_every: int = 2048  # the most remeasure_every backs off to while k = 0 wins
    # Measured wall-clock goodput with and without drafting per bucket, which may keep the
    # policy's rows at k = 0 whatever the prediction (specdec.speculation_gate); None: off.
    gate: GateConfig | None = field(default_factory=GateConfig)
    # Rounds of at least this many sequences keep the policy's rows at k = 0, decided by
    # the operator, not measured (as vLLM's speculative_disable_by_batch_size): where the
    # draft's cores also serve the frontend, what drafting costs it is in no round the
    # gate can time (None: no such size) [sequences].
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        default_k = self.max_k if self.default_k is None else self.default_k
        if (
            not 0 <= default_k <= self.max_k
            or self.probe_every < self.probe_rounds
            or self.explore_rounds < 1
            or (self.disable_by_batch_size is not None and self.disable_by_batch_size < 1)
        ):
            raise ValueError(
                "need 0 <= default_k <= max_k, probe_every >= probe_rounds, "
                "explore_rounds >= 1, disable_by_batch_size >= 1"
            )


class SpeculationLength:
    """The draft length k per domain and batch size, chosen for goodput (pure).

    Acceptance alone cannot decide whether to speculate: with acceptance flat, the best k
    falls to 0 as the batch grows (verification stops being memory-bound, and on a shared
    host the draft competes with the target for cores). So the policy predicts committed
    tokens per second of a row, ``E(α̂, k) / T(b, k)``, and takes the best k, where

    * ``α̂ = A / (A + R)`` per domain: decayed counts of accepted tokens and of rounds that
      hit a rejection (independent of k, unlike accepted/drafted), and
      ``E(α, k) = (1 - α^(k+1)) / (1 - α)`` tokens per round, with k the drafts a row
      really gets when k is asked for (measured per bucket: a draft with a confidence stop
      proposes far fewer than a large k, and counting k would make a long k look cheap);
    * ``T(b, k)``: the measured critical-path time of engine rounds in the batch-size
      bucket of ``b`` whose longest draft was k (verification, waiting for drafts and
      every overhead: what the pipeline really costs, overlap and contention included),
      interpolated linearly in k between measured lengths.

    Speculation must beat plain decoding by ``min_gain`` (predicted) to be chosen: near
    break-even the estimates' noise, and the cores the draft takes from the frontend (not
    on the core's critical path, so not in T), would make it a loss as often as a gain.

    Rounds are measured as they come; in each bucket a few rounds are run at each of
    ``k = 0``, 1 and ``max_k`` first (every policy-driven row of the round at that k,
    :meth:`plan_round`) and again every ``remeasure_every`` rounds that could use them,
    so that the costs of the choices not taken stay current; none of these run while the
    gate says (or, with requests waiting, presumes) that drafting loses in the bucket, and
    until a k > 0 has a measured time rows draft ``default_k``. ``k = 0`` wins when no k is
    predicted to pay. A disabled domain is re-probed with ``probe_k`` for ``probe_rounds``
    engine rounds every ``probe_every``, so a domain whose traffic recovers gets
    speculation back while a losing one costs at most ``probe_rounds / probe_every`` of
    its rounds. A drift alert (:meth:`on_drift`) replaces the domain's history with the
    detector's recent estimate, so the next choice already reflects it. A request that
    sets its own k is not asked about. Its settings: :class:`LengthPolicyConfig`.
    """

    def __init__(self, config: LengthPolicyConfig):
        self.config = config
        c, max_k = config, config.max_k
        self.max_k, self.default_k = max_k, max_k if c.default_k is None else c.default_k
        self.decay, self.min_tokens, self.cost_decay = c.decay, c.min_tokens, c.cost_decay
        self.explore_rounds, self.remeasure_every = c.explore_rounds, c.remeasure_every
        self.probe_every, self.probe_rounds = c.probe_every, c.probe_rounds
        self.probe_k = min(max(1, c.probe_k), max(1, max_k))
        self.min_gain = c.min_gain
        self.max_remeasure_every = max(c.remeasure_every, c.max_remeasure_every)
        # The lengths every bucket measures: the two ends and one draft token.
        self.anchors = sorted({0, min(1, max_k), max_k})
        self._domains: dict[str, _Domain] = {}
        self._costs: dict[int, _Costs] = {}
        self._round = 0  # engine rounds planned (probing runs on this clock)
        self.gate = SpeculationGate(c.gate) if c.gate is not None else None
        self._open = True  # the gate's word for the round being planned
        self._trialling = False  # ... given for one of its measurements
        self._planned: tuple[int, bool] | None = None  # ... for its (bucket, queued)
        self._disabled = False  # the round being planned is at or past disable_by_batch_size

    # ----- observations -------------------------------------------------------------------

    def observe_round(self, domain: str, drafted: int, accepted: int) -> None:
        """One sequence's round: ``accepted`` of ``drafted`` drafts (a rejection if fewer)."""
        if drafted <= 0:
            return
        d = self._domains.setdefault(domain, _Domain())
        d.accepted = self.decay * d.accepted + accepted
        d.rejections = self.decay * d.rejections + (1.0 if accepted < drafted else 0.0)

    def observe_round_time(
        self,
        batch_size: int,
        k: int,
        seconds: float,
        rows: Sequence[tuple[str, int, int]] | None = None,
    ) -> None:
        """An engine round over ``batch_size`` rows planned at ``k`` drafts (the longest
        asked for) took ``seconds`` on the critical path (drafts waited for, verification,
        overhead). ``rows``: ``(domain, drafts it got, accepted)`` of each row that asked
        for ``k`` drafts (None: every row got k, nothing more is known)."""
        if seconds <= 0 or not 0 <= k <= self.max_k:
            return
        c, decay = self._bucket(batch_size), self.cost_decay
        if k in c.fresh:
            c.fresh.discard(k)
            c.forget(k)
        c.update(c.seconds, ("seconds", k), k, seconds, decay)
        if k > 0:
            got = float(k) if not rows else sum(min(n, k) for _, n, _ in rows) / len(rows)
            c.update(c.drafted, ("drafted", k), k, got, decay)
            sums: dict[str, list[float]] = {}  # domain -> [expected, committed] tokens
            for domain, _n, accepted in rows or ():
                alpha = self.alpha(domain)
                if alpha is not None:
                    pair = sums.setdefault(domain, [0.0, 0.0])
                    pair[0] += expected_tokens_per_round(alpha, got)
                    pair[1] += accepted + 1
            if sums:
                expected, committed = map(sum, zip(*sums.values(), strict=True))
                c.update(c.ratio, ("ratio", k), k, committed / expected, decay)
            for domain, (expected, committed) in sums.items():
                by_k = c.domain_ratio.setdefault(domain, {})
                c.update(by_k, ("ratio", k, domain), k, committed / expected, decay)
        c.count[k] = c.count.get(k, 0) + 1
        c.last[k] = c.rounds

    def observe_positions(self, batch_size: int, rows: Sequence[tuple[str, int, int]]) -> None:
        """The draft positions rows of a round reached and got past, each row as
        ``(domain, drafts it asked for, drafts accepted)``: rows of the draft model that
        got drafts, whatever k they asked (see ``_Costs.reached``). A row that accepted
        ``a`` reached positions 1..a + 1 and got past 1..a; one that accepted all it asked
        for says nothing past its cap. One observation per domain and round."""
        c = self._bucket(batch_size)
        by_domain: dict[str, list[tuple[int, int]]] = {}
        for domain, cap, a in rows:
            if cap > 0:
                by_domain.setdefault(domain, []).append((min(cap, self.max_k), a))
        d = self.cost_decay
        for domain, got in by_domain.items():
            reached = c.reached.setdefault(domain, [])
            passed = c.passed.setdefault(domain, [])
            while len(reached) < max(cap for cap, _ in got):
                reached.append(0.0)
                passed.append(0.0)
            for m in range(1, len(reached) + 1):  # position m
                got_to = sum(m <= cap and a >= m - 1 for cap, a in got)
                if got_to:
                    reached[m - 1] = d * reached[m - 1] + got_to
                    passed[m - 1] = d * passed[m - 1] + sum(m <= cap and a >= m for cap, a in got)

    def survival_tokens(self, batch_size: int, k: int, domain: str) -> float | None:
        """Tokens a row of ``domain`` commits per round at k from the positions its rows
        got past (``_Costs.reached``): ``1 + sum over m <= k of P(past 1..m)``; None
        while the first position has too few rows, or one up to k that rows may get to
        has never been reached (k longer than any row was asked for)."""
        c = self._costs.get(batch_bucket(batch_size))
        reached = [] if c is None else c.reached.get(domain, [])
        if len(reached) < k or reached[0] < self.explore_rounds:
            return None
        passed, tokens, past = c.passed[domain], 1.0, 1.0
        for m in range(k):
            if past <= 0:  # no row got this far: none gets further
                break
            if reached[m] <= 0:
                return None
            past *= passed[m] / reached[m]
            tokens += past
        return tokens

    def _bucket(self, batch_size: int) -> _Costs:
        """The cost bookkeeping of ``batch_size``'s bucket, created on first use."""
        c = self._costs.get(batch_bucket(batch_size))
        if c is None:
            c = self._costs[batch_bucket(batch_size)] = _Costs(remeasure_every=self.remeasure_every)
        return c

    def on_drift(self, domain: str, current_alpha: float, weight: float | None = None) -> None:
        """A drift alert: forget the domain's history in favour of the recent estimate."""
        d = self._domains.setdefault(domain, _Domain())
        w = self.min_tokens if weight is None else weight
        d.accepted, d.rejections = current_alpha * w, (1.0 - current_alpha) * w
        d.probe_until = 0
        for c in self._costs.values():  # measured against the α̂ just replaced
            c.forget_ratios(domain)

    def new_draft(self) -> None:
        """New draft weights serve: every domain's acceptance is unknown again (each
        drafts at ``default_k`` until its α̂ is measured anew, so a domain the old draft
        lost speculation on gets it back where the new one pays), and the gate measures
        drafting's goodput afresh. Round costs stay: the draft's shape did not change; the
        ratios to E go (how sure the draft is where it stops belongs to its weights)."""
        self._domains.clear()
        for c in self._costs.values():
            c.forget_ratios()
        if self.gate is not None:
            self.gate.new_draft()

    def alpha(self, domain: str) -> float | None:
        d = self._domains.get(domain)
        # (a tolerance: a drift alert sets A + R to min_tokens, which its float parts,
        # e.g. 0.05 x 24 + 0.95 x 24, may sum to just under)
        return d.alpha() if d is not None and d.tokens >= self.min_tokens - 1e-9 else None

    # ----- the decision -------------------------------------------------------------------

    def plan_round(
        self, batch_size: int, domains: Collection[str] | None = None, queued: bool = False
    ) -> int | None:
        """Call once per engine round, before :meth:`choose`: the k every policy-driven row
        runs at this round when it is a cost measurement, else None.

        ``domains``: those of the round's policy-driven rows; ``queued``: requests wait
        for a slot (the gate measures that state apart). A re-measurement waits while
        every one of them has an acceptance too low for any k to pay, whatever the costs
        (``1 / (1 - α̂) < 1 + min_gain``: even free drafts would not gain enough), e.g.
        after a drift alert said 0: drafting their rows would cost time for nothing."""
        self._round += 1
        c = self._bucket(batch_size)
        bucket = batch_bucket(batch_size)
        self._planned = (bucket, queued)
        self._disabled = self.disabled_by_batch_size(batch_size)
        if self._disabled:
            # Neither measured nor aged: a size that never drafts has no use for costs.
            self._open, self._trialling = False, False
            return None
        if self._ages_costs(bucket, domains, queued):
            c.rounds += 1
        if c.forced_left <= 0:
            c.forced = None
            stale = self._stale_anchors(c)
            remeasure = bool(stale) and c.count.get(stale[0], 0) >= self.explore_rounds
            if remeasure and domains is not None and not any(map(self._may_pay, domains)):
                stale = []  # not now: checked again next round
            elif stale and self.gate is not None and self.gate.favours_off(bucket, queued):
                # Drafting loses here by wall time (or, with requests waiting, is presumed
                # to until measured): its costs can wait, the first measurement's too.
                stale = []
            elif remeasure and stale[0] == self.anchors[-1]:  # one cycle: the longest anchor
                c.remeasures += 1
                # Back off while nothing paid here since the last cycle, once two cycles
                # agreed that the first exploration (cold caches, a fresh server) was right.
                if not c.chose_k and c.remeasures > 2:
                    c.remeasure_every = min(2 * c.remeasure_every, self.max_remeasure_every)
                c.chose_k = False
            if stale:
                c.forced = stale[0]
                # Two rounds at least: the first after a change of k may be unrepresentative
                # (the engine does not report it: rows resuming drafting prefill first). A
                # re-measurement runs a whole exploration's rounds and replaces the old data.
                c.forced_left = max(2, self.explore_rounds - c.count.get(c.forced, 0))
                if remeasure:
                    c.forced_left = self.explore_rounds + 1
                    c.fresh.add(c.forced)
                c.tries[c.forced] = c.tries.get(c.forced, 0) + c.forced_left
                c.tries_at[c.forced] = c.rounds
        self._open, self._trialling = True, False
        if c.forced is None:
            if self.gate is not None:
                self._open = self.gate.is_open(bucket, queued)
                self._trialling = self.gate.trialling
            return None
        c.forced_left -= 1
        return c.forced

    def _ages_costs(self, bucket: int, domains: Collection[str] | None, queued: bool) -> bool:
        """Whether a round of ``bucket`` counts towards its costs' age: one that could use
        them, with rows of the policy's (``domains``; None: unknown, counted) in a state
        whose gate is not against drafting. Counting every round, at 32 and 64 concurrent
        requests on the demo pair the costs of 16 rows went stale during each wave's
        saturated rounds (gate closed) and the waves of requests that turned speculation
        off, and were measured again at the start of every wave's unsaturated tail: 4
        rounds at k = 12 of 16 rows, each ~80 ms for what plain rounds commit in ~60, and
        4 at k = 1, some 4 % of the wave (bench.policy --shipped, a round log). So a
        bucket closed for long opens on its old k > 0 costs (its gate's drafting trials
        ran on them too); the k = 0 cost, observed in every plain round, stays current."""
        if domains is not None and not domains:
            return False
        return self.gate is None or not self.gate.favours_off(bucket, queued)

    def _stale_anchors(self, c: _Costs) -> list[int]:
        """The anchors of bucket ``c`` due a cost measurement, in anchor order. A forced
        round may not measure its k (rows with their own k set the round's length): an
        anchor is forced at most 2 x explore_rounds times before it has data, then again
        only when its data is remeasure_every rounds old (:meth:`_ages_costs`), so rows
        outside the policy can never hold the policy's rows at one k."""
        return [
            k
            for k in self.anchors
            if (
                c.count.get(k, 0) < self.explore_rounds
                and c.tries.get(k, 0) < 2 * self.explore_rounds
            )
            or c.rounds - max(c.last.get(k, 0), c.tries_at.get(k, 0)) > c.remeasure_every
        ]

    def admitted(self, batch_size: int, queued: bool = False) -> bool:
        """Rows were admitted after the next round was planned (at the size of the round
        before, rows that finished in it included): the round runs ``batch_size`` rows
        (``queued``: requests still wait). Returns whether the plan holds (the same bucket
        and queue state); if not, the gate's answer for the batch the round really runs
        (:meth:`SpeculationGate.decision`) replaces it. An idle engine plans its next round
        at the first request of a burst: at 16 concurrent requests on the demo pair every
        wave's other 15 then drafted at k = 9-12 (one sequence's choice, or a measurement
        of 1-3 sequences), in a bucket whose gate was closed."""
        state = (batch_bucket(batch_size), queued)
        disabled = self.disabled_by_batch_size(batch_size)
        if state == self._planned and disabled == self._disabled:
            return True
        self._planned, self._disabled = state, disabled
        if disabled:
            self._open, self._trialling = False, False
        elif self.gate is not None:
            self._open, self._trialling = self.gate.decision(*state)
        else:
            self._open, self._trialling = True, False
        return False

    @property
    def disabled(self) -> bool:
        """The round being planned (or re-decided at admission) is past
        ``disable_by_batch_size``: its policy rows run at k = 0 and it tells nothing."""
        return self._disabled

    def disabled_by_batch_size(self, batch_size: int) -> bool:
        """Whether rounds of ``batch_size`` sequences are past ``disable_by_batch_size``."""
        cap = self.config.disable_by_batch_size
        return cap is not None and batch_size >= cap

    @property
    def planned_bucket(self) -> int | None:
        """The batch-size bucket the round being planned was planned (or re-decided) for."""
        return None if self._planned is None else self._planned[0]

    @property
    def gate_closed(self) -> bool:
        """The gate keeps the policy's rows at k = 0 for the round being planned by its
        decision (not for a measurement): a row the draft does not hold need not be sent
        to it. (Per round: the next may fall in another bucket or queue state.)"""
        return not self._open and not self._trialling

    @property
    def measuring_off(self) -> bool:
        """The round being planned keeps the policy's rows at k = 0 to measure the gate's
        closed choice: a passing k = 0, for which the draft should not forget a row."""
        return self._trialling and not self._open

    def observe_round_wall(
        self, batch_size: int, drafted: bool, tokens: int, seconds: float, queued: bool = False
    ) -> None:
        """A round (not a cost measurement, every row's k the policy's) committed
        ``tokens`` in ``seconds`` of the loop's wall time, the work before it included but
        admitted requests' prefills (``RoundStats.decode_wall_s``); ``drafted``: whether
        its rows were asked for drafts;
        ``queued``: requests waited for a slot. What the gate decides from."""
        if self.gate is not None:
            self.gate.observe(batch_bucket(batch_size), drafted, tokens, seconds, queued)

    def _may_pay(self, domain: str) -> bool:
        """Whether some k could pay for ``domain`` at some cost: unknown α̂ counts as yes."""
        alpha = self.alpha(domain)
        return alpha is None or 1.0 / max(1e-9, 1.0 - alpha) >= 1.0 + self.min_gain

    def round_time(self, batch_size: int, k: int) -> float | None:
        """Predicted round time at draft length k (None until the bucket has data)."""
        c = self._costs.get(batch_bucket(batch_size))
        if c is None or not c.seconds:
            return None
        if k == 0:
            return c.seconds.get(0)
        return _interpolate(c.seconds, k)

    def drafts_per_row(self, batch_size: int, k: int) -> float:
        """The drafts a drafting row is expected to get when k is asked for: measured in
        the bucket (interpolated between measured lengths, never above k), else k."""
        c = self._costs.get(batch_bucket(batch_size))
        got = None if c is None or k == 0 else _interpolate(c.drafted, k)
        return float(k) if got is None else min(float(k), got)

    def tokens_per_row(
        self, alpha: float, batch_size: int, k: int, domain: str | None = None
    ) -> float:
        """Tokens a row of ``domain`` commits per round at k: ``E(α, drafts it gets)``,
        scaled by how far that domain's rows at k fell short of that prediction or beat it
        (measured), else scaled down by the bucket's rows'; within [1, drafts + 1]: a round
        commits one token at least and every draft at most.

        Scaling up is safe where scaling down is not: a k whose estimate is too high is
        chosen and so measured every round until the estimate is right, while a k whose
        estimate is too low waits for its next re-measurement. Only the domain's own rows
        can show it (another domain's would not be corrected by its rounds)."""
        drafts = self.drafts_per_row(batch_size, k)
        e = expected_tokens_per_round(alpha, drafts)
        c = self._costs.get(batch_bucket(batch_size))
        if c is None:
            return e
        direct = None if domain is None else self.survival_tokens(batch_size, k, domain)
        if direct is not None:
            return direct
        ratio = _interpolate(c.domain_ratio.get(domain, {}), k) if domain is not None else None
        if ratio is None:
            pooled = _interpolate(c.ratio, k)
            ratio = None if pooled is None else min(1.0, pooled)
        return e if ratio is None else min(drafts + 1.0, max(1.0, e * ratio))

    def predicted_k(self, domain: str, batch_size: int) -> int:
        """The goodput-maximising k from what is measured (``default_k`` until then)."""
        alpha = self.alpha(domain)
        t0 = self.round_time(batch_size, 0)
        # (k = 0 alone measured, e.g. while the gate kept drafting's costs waiting, says
        # nothing of any k: its trial of drafting must draft)
        if alpha is None or t0 is None or not self._costs[batch_bucket(batch_size)].has_k():
            return self.default_k
        best, best_rate = 0, (1.0 + self.min_gain) / t0  # speculation must clearly pay
        for k in range(1, self.max_k + 1):
            t = self.round_time(batch_size, k)
            tokens = self.tokens_per_row(alpha, batch_size, k, domain)
            # A k whose rounds would not commit min_gain more tokens than plain decoding
            # never pays, whatever its measured time: a k > 0 measured faster than k = 0
            # (cold first rounds at k = 0, a busy host) must not bring drafting back at
            # an acceptance near 0, e.g. after a drift alert said 0.
            if t is None or not self._commits_enough(alpha, batch_size, k, tokens):
                continue
            rate = tokens / t
            if rate > best_rate:
                best, best_rate = k, rate
        if best > 0:  # speculation pays here: keep the costs of its rivals current
            c = self._costs[batch_bucket(batch_size)]
            c.chose_k, c.remeasure_every = True, self.remeasure_every
        return best

    def _commits_enough(self, alpha: float, batch_size: int, k: int, tokens: float) -> bool:
        """Whether rows at k commit ``min_gain`` more tokens than plain decoding: both by the
        formula and by its measured scaling (``tokens``), so that a ratio measured against
        an older α̂ cannot bring drafting back at α̂ = 0."""
        formula = expected_tokens_per_round(alpha, self.drafts_per_row(batch_size, k))
        return min(tokens, formula) >= 1.0 + self.min_gain

    def choose(
        self,
        domain: str,
        batch_size: int,
        requested: int | None = None,
        forced: int | None = None,
    ) -> int:
        """k for one sequence's next round; ``requested`` (the request's own k) wins, then
        ``forced`` (this round's measurement, from :meth:`plan_round`)."""
        if requested is not None:
            return requested
        d = self._domains.setdefault(domain, _Domain())
        d.batch_size = batch_size
        if forced is not None:
            return forced
        # Measured (or, with requests waiting, presumed): drafting loses at this batch size
        # now. Before any probe: a probe's rounds draft every row of the domain, which would
        # take rows back into the draft (a prefill each) and set them apart from the rest
        # of the batch, where drafting was decided against.
        if not self._open:
            d.k = 0
            return 0
        if self._round < d.probe_until:
            d.k = self.probe_k
            return self.probe_k
        k = self.predicted_k(domain, batch_size)
        d.k = k
        if k > 0:
            d.disabled_at = None
            return k
        if d.disabled_at is None:
            d.disabled_at = self._round
        elif self._round - d.disabled_at >= self.probe_every:
            d.disabled_at = self._round
            d.probe_until = self._round + self.probe_rounds
            d.k = self.probe_k
            return self.probe_k
        return 0

    def round_time_ratios(self, batch_size: int) -> dict[int, float]:
        """``T(b, k) / T(b, 0)`` per k >= 1 with data: the tokens a round at k must commit
        to pay for itself, i.e. break-even is ``E(α, k) = ratio`` (measured, so overlap,
        waits and contention are in it; the drift detector's break-even comes from it)."""
        t0 = self.round_time(batch_size, 0)
        if t0 is None:
            return {}
        ratios = {}
        for k in range(1, self.max_k + 1):
            t = self.round_time(batch_size, k)
            if t is not None:
                ratios[k] = round(t / t0, 4)
        return ratios

    def state(self) -> dict[str, dict]:
        """Per domain: the last chosen k, α̂ and the measured round-time ratios of its
        batch size (for the gauges, the drift detector's break-even and the stats)."""
        ratios: dict[int, dict[int, float]] = {}  # per bucket: domains share their costs
        out = {}
        for name, d in self._domains.items():
            if d.k is None:
                continue
            bucket = batch_bucket(d.batch_size)
            if bucket not in ratios:
                ratios[bucket] = self.round_time_ratios(d.batch_size)
            out[name] = {"k": d.k, "alpha": self.alpha(name), "round_time_ratio": ratios[bucket]}
        return out


def _interpolate(by_k: dict[int, float], k: int) -> float | None:
    """A per-k measurement at ``k >= 1``: measured, or linear between the nearest measured
    lengths around it, or past the data the nearest one; None without data at k >= 1."""
    if k in by_k:
        return by_k[k]
    drafted = sorted((m, v) for m, v in by_k.items() if m > 0)
    if not drafted:
        return None
    below = [(m, v) for m, v in drafted if m < k]
    above = [(m, v) for m, v in drafted if m > k]
    if below and above:
        (k0, v0), (k1, v1) = below[-1], above[0]
        return v0 + (v1 - v0) * (k - k0) / (k1 - k0)
    return (below or above)[-1 if below else 0][1]
