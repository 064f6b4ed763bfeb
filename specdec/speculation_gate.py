"""Whether speculating pays at all in a batch-size bucket, by measured wall-clock goodput.

:class:`specdec.policy.SpeculationLength` predicts each row's goodput from acceptance
and per-round costs: ``E(α̂, k) / T(b, k)`` against ``1 / T(b, 0)``. That is right per
row, but a round is not the whole story. Speculating rows finish their requests on
different rounds, so new requests are admitted one by one between rounds instead of
together, and a slot a request just left waits a round for the next one; on a shared
host the draft's cores are the frontend's too. None of that is in ``T``. Measured
on the demo pair at 16 rows, the prediction said +10 % where the engine committed 7-13 %
fewer tokens per second than without speculation.

So this gate measures the thing itself: committed tokens per wall second of the engine's
loop (each round with the work before it, less the prefills of admitted requests:
``RoundStats.decode_wall_s``), separately for rounds that drafted and rounds that did
not, per bucket (and apart while requests wait for a slot). Once both are known, the
better one is taken, drafting only where it measured ``min_gain`` faster; now and then
the other is run for ``compare_rounds`` rounds, measured afresh, to keep its figure
current (conditions change: load, prompts, the batch mix): every ``compare_every``
rounds, doubling while each measurement confirms the choice. Drafting runs first, except
while requests wait for a slot (:meth:`SpeculationGate._first_choice`). A closed gate
keeps the length policy's rows at k = 0; requests that set their own k are not asked.
Pure: no clocks, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def batch_bucket(num_seqs: int) -> int:
    """Power-of-two bucket of a batch size: 1, 2-3, 4-7, 8-15, ... -> 1, 2, 3, 4, ..."""
    return max(1, num_seqs).bit_length()


@dataclass(frozen=True)
class GateConfig:
    """The settings of :class:`SpeculationGate` (rounds: engine rounds of one bucket)."""

    # Rounds one measurement of the choice not running lasts (its rounds at k = 0 do not
    # count towards the scheduler's pause of a row). With 6-round measurements (4 for
    # drafting's first) the figures of one server at 16 rows read drafting at 488 to 1179
    # tokens/s against 835 to 1097 without, and the choice at each comparison was a coin
    # toss (64 concurrent, bench.policy --shipped; then with admissions' prefills, which
    # RoundStats.decode_wall_s now leaves out).
    compare_rounds: int = 12
    compare_every: int = 128  # rounds between such measurements, at first ...
    max_compare_every: int = 2048  # ... doubling up to this while they confirm the choice
    min_rounds: int = 8  # rounds a choice needs measured before its figure is used
    decay: float = 0.98  # per observed round, of the running choice's tokens and seconds
    # Drafting is kept only where it measures this much faster (0.1: 10 %). What it costs
    # the rest of the host is not in the core's rounds: on a shared host the draft's core
    # also runs the HTTP proxy, the replicas and their detokenizers, which drafting slows.
    # Gated on bare wall goodput, 32 and 64 concurrent requests over HTTP ran at 0.93 and
    # 0.96x speculation off (bench.policy --shipped), where in process the same engine ran
    # at 0.97-1.02x: the rounds saw a tie and the clients a loss.
    min_gain: float = 0.1
    # ... from this batch size's bucket on. One sequence's frontend work is small, and its rounds
    # (1 to k + 1 tokens each) move a measurement by more than the margin: with it, one
    # noisy trial closed the gate for hundreds of rounds where drafting paid 1.2x.
    min_gain_from: int = 2
    # ... and this much while requests wait for a slot (the engine saturated, measured
    # apart). Then every round admits what the last one ended, and the waiting requests'
    # HTTP work shares the draft's core. The same engine at 16 rows and 64 concurrent
    # requests ran at 0.97-1.02x off in process and 0.90-0.95x over HTTP, and its rounds,
    # at 10 %, still measured drafting faster for most of a run.
    min_gain_queued: float = 0.25

    def __post_init__(self) -> None:
        if (
            self.compare_rounds <= self.min_rounds  # a trial must yield a figure
            or self.min_rounds < 1
            or not 0.0 < self.decay <= 1.0
            or self.max_compare_every < self.compare_every
            or min(self.min_gain, self.min_gain_queued) < 0
            or self.min_gain_from < 1
        ):
            raise ValueError(
                "need compare_rounds > min_rounds >= 1, 0 < decay <= 1, "
                "max_compare_every >= compare_every, min_gain(_queued) >= 0, min_gain_from >= 1"
            )


@dataclass
class _Gate:
    """One bucket: decayed tokens and seconds per choice (True: rounds that drafted)."""

    tokens: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    seconds: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    rounds: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    planned: int = 0  # rounds planned in this bucket
    best: bool | None = None  # the choice the figures favoured at the last decision
    trial: bool | None = None  # the choice being measured now, if any
    trial_left: int = 0
    every: int = 0  # rounds between measurements of the choice not taken, now
    next_compare: int = 0  # planned round at which it is measured again

    def rate(self, choice: bool) -> float | None:
        """Committed tokens per wall second of the rounds that made ``choice``."""
        if self.seconds[choice] <= 0:
            return None
        return self.tokens[choice] / self.seconds[choice]

    def forget(self, choice: bool) -> None:
        self.tokens[choice] = self.seconds[choice] = 0.0
        self.rounds[choice] = 0


class SpeculationGate:
    """Open (speculation may run) or closed, per batch-size bucket, from measured
    wall-clock goodput with and without drafting (module docstring)."""

    def __init__(self, config: GateConfig | None = None):
        self.config = config or GateConfig()
        self._gates: dict[tuple[int, bool], _Gate] = {}  # (bucket, queued) -> figures
        self.trialling = False  # the last is_open() answered for a measurement's round

    def is_open(self, bucket: int, queued: bool = False) -> bool:
        """Whether the next round's policy rows may draft; call once per planned round of
        the batch-size ``bucket`` (:func:`batch_bucket`); ``queued``:
        requests wait for a slot (measured apart from the same bucket without)."""
        c = self.config
        g = self._gate(bucket, queued)
        g.planned += 1
        self.trialling = g.trial is not None
        if g.trial is not None:
            choice = g.trial
            g.trial_left -= 1
            if g.trial_left <= 0:
                g.trial = None
            return choice
        first = self._first_choice(bucket, queued)
        if g.best is None and g.rounds[first] < c.min_rounds:
            return first  # (drafting may still run at k = 0: the length policy's choice)
        missing = [choice for choice in (first, not first) if g.rounds[choice] < c.min_rounds]
        if missing:
            # Measured at most once per compare_every rounds: a trial whose rounds were not
            # observed (other rows set their lengths) leaves the last decision (before any,
            # the first choice) meanwhile.
            if g.planned < g.next_compare:
                return first if g.best is None else g.best
            if g.best is not None:  # the last measurement yielded no figure: less often
                g.every = min(2 * g.every, c.max_compare_every)
            return self._trial(g, missing[0])
        best = self._drafting_pays(g, bucket, queued)
        if g.best is not None and g.planned >= g.next_compare:
            # The last measurement of the other choice confirmed this one: wait longer.
            g.every = min(2 * g.every, c.max_compare_every) if best == g.best else c.compare_every
            g.best = best
            return self._trial(g, not best)
        if g.best is None:
            g.best, g.next_compare = best, g.planned + g.every
        return best

    def decision(self, bucket: int, queued: bool = False) -> tuple[bool, bool]:
        """(open, trialling) as :meth:`is_open` would answer now, counting no round: a
        running measurement's choice, else what both figures say once measured, else the
        last decision, else the first choice. For rows admitted between rounds into a
        batch of another bucket than the one the round was planned in
        (SpeculationLength.admitted)."""
        g = self._gates.get((bucket, queued))
        if g is not None and g.trial is not None:
            return g.trial, True
        return not self.favours_off(bucket, queued), False

    def _first_choice(self, bucket: int, queued: bool) -> bool:
        """The choice a state runs (and measures) first: drafting, except with requests
        waiting for a slot in a bucket where drafting must show a margin. There the
        engine's throughput is all that counts, and drafting must measure
        ``min_gain_queued`` faster, which it rarely does on a host where the draft shares
        the cores (at 64 concurrent requests on the demo pair it won 6 % of the saturated
        rounds); measuring it first cost every fresh server its first rounds at the
        longest k, and its first trial waits ``compare_every`` rounds."""
        return not (queued and self._has_margin(bucket))

    def _has_margin(self, bucket: int) -> bool:
        """Whether drafting must measure a margin faster in ``bucket`` (``min_gain_from``)."""
        return bucket >= batch_bucket(self.config.min_gain_from)

    def _gate(self, bucket: int, queued: bool) -> _Gate:
        """The figures of one state, created at the first call (a state measuring not
        drafting first tries drafting after ``compare_every`` rounds, not at once)."""
        key = (bucket, queued)
        if key not in self._gates:
            every = self.config.compare_every
            later = 0 if self._first_choice(bucket, queued) else every
            self._gates[key] = _Gate(every=every, next_compare=later)
        return self._gates[key]

    def new_draft(self) -> None:
        """New draft weights: what drafting rounds measured is stale in every bucket
        (the rounds without drafts still are what they were); drafting is measured next
        (first, or in a trial at once where not drafting runs first)."""
        for g in self._gates.values():
            g.forget(True)
            g.trial, g.trial_left, g.best = None, 0, None
            g.every, g.next_compare = self.config.compare_every, g.planned

    def favours_off(self, bucket: int, queued: bool = False) -> bool:
        """Whether the bucket's figures say drafting loses (while one is being measured
        afresh: what they said before; before any decision, whether drafting is not the
        state's first choice): the length policy then skips measuring its costs, which
        drafting would pay for."""
        g = self._gates.get((bucket, queued))
        if g is not None and min(g.rounds.values()) >= self.config.min_rounds:
            return not self._drafting_pays(g, bucket, queued)
        if g is not None and g.best is not None:
            return not g.best
        return not self._first_choice(bucket, queued)  # nothing decided yet: the prior

    def _drafting_pays(self, g: _Gate, bucket: int, queued: bool) -> bool:
        """Whether drafting measured faster than not, by ``min_gain`` (``min_gain_queued``
        while requests wait) in the bucket of ``min_gain_from`` sequences and above, both
        rates known."""
        c = self.config
        margin = 0.0  # one sequence: see min_gain_from
        if self._has_margin(bucket):
            margin = c.min_gain_queued if queued else c.min_gain
        return g.rate(True) >= (1.0 + margin) * g.rate(False)

    def _trial(self, g: _Gate, choice: bool) -> bool:
        """Measure ``choice`` afresh for ``compare_rounds`` rounds, starting with this one."""
        self.trialling = True
        g.forget(choice)
        g.trial, g.trial_left = choice, self.config.compare_rounds - 1
        if g.trial_left <= 0:
            g.trial = None
        g.next_compare = g.planned + g.every
        return choice

    def observe(
        self, bucket: int, drafted: bool, tokens: int, seconds: float, queued: bool = False
    ) -> None:
        """A round of the batch-size ``bucket`` (``drafted``: its rows were asked for drafts;
        the caller passes only rounds whose lengths were all the policy's) committed
        ``tokens`` in ``seconds`` of wall time, the work between it and the round before
        included. Attributed by what the round did, not by what was planned."""
        if seconds <= 0:
            return
        d = self.config.decay
        g = self._gate(bucket, queued)
        g.tokens[drafted] = d * g.tokens[drafted] + tokens
        g.seconds[drafted] = d * g.seconds[drafted] + seconds
        g.rounds[drafted] += 1

    def rates(self) -> dict[tuple[int, bool], dict[str, float]]:
        """Measured tokens/s per (bucket, queued), with and without drafting (for tests
        and debugging; not JSON keys)."""
        out: dict[tuple[int, bool], dict[str, float]] = {}
        for key, g in self._gates.items():
            out[key] = {
                ("on" if ch else "off"): round(r, 2)
                for ch in (True, False)
                if (r := g.rate(ch)) is not None
            }
        return out
