"""Speculation policies: pure decisions the draft and the engine core consult each round.

:class:`SpeculationLength` chooses the draft length k per domain and batch size from
measured acceptance and costs (below).

:class:`SpeculationWidth` decides how many outcomes the draft prepares per round while
the target verifies. Branches are free only while they finish before verification does:
branches still being drafted when the outcome arrives are dropped, and where draft and
target share a machine (two processes on a 2-core host, or one GPU) drafting during
verification also slows the target. So nothing here is assumed, it is measured:

* the width grows while speculation finishes with time to spare and shrinks when it was
  cut short; speculation pauses (re-probed now and then) while its hit rate is too low;
* whether speculating while verifying pays at all is decided by goodput: per batch-size
  bucket, committed tokens per second of rounds with and without it, each measured in
  turn and the one not chosen re-measured every ``compare_every`` rounds. Without it
  the pipeline is the sequential one (fresh drafts after each outcome), so overlap mode
  is never slower than sequential mode for long.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.speedup import best_k


def batch_bucket(num_seqs: int) -> int:
    """Power-of-two bucket of a batch size: 1, 2-3, 4-7, 8-15, ... -> 1, 2, 3, 4, ..."""
    return max(1, num_seqs).bit_length()


@dataclass
class _Bucket:
    """Goodput bookkeeping of one batch-size bucket."""

    rounds: int = 0  # rounds observed
    rates: dict[bool, float] = field(default_factory=dict)  # speculating? -> tokens/s
    choice: bool | None = None  # the choice of the rounds now running
    measuring: bool = False  # the current choice runs for a measurement of fixed length
    left: int = 0  # rounds of the measurement still to observe
    next_compare: int = 0  # round at which the choice not taken is measured again
    skip: bool = False  # the next observed round is the first under a new choice
    tokens: float = 0.0  # decayed sums over the current choice's rounds
    seconds: float = 0.0
    counted: int = 0  # rounds in those sums


@dataclass
class SpeculationWidth:
    """Branches per sequence to prepare next round (additive increase, cut on overrun),
    or none where measured goodput says speculating during verification does not pay."""

    max_width: int
    adaptive: bool = True
    min_hit_rate: float = 0.15  # below this (moving average), speculation pauses
    probe_every: int = 32  # while paused, speculate once every this many rounds
    slack: float = 0.6  # grow only if speculation took under this share of verification
    decay: float = 0.9
    compare_every: int = 256  # rounds between re-measurements of the choice not taken
    compare_rounds: int = 6  # rounds one measurement lasts (the first is not counted)
    goodput_decay: float = 0.97  # per round, for the choice that keeps running
    width: int = 0
    hit_rate: float = 0.5
    _paused_rounds: int = 0
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _last: _Bucket | None = None  # the bucket of the round now running

    def __post_init__(self) -> None:
        self.width = self.max_width

    def budget(self, num_seqs: int, new_round: bool = True) -> int:
        """Branches to prepare this round across ``num_seqs`` sequences (0: none).

        ``new_round`` False: a call between rounds (sequences just admitted) that follows
        the current choice without being counted as the round the next goodput belongs to.
        """
        if self.max_width <= 0 or num_seqs <= 0:
            return 0
        if not self.adaptive:
            return self.max_width * num_seqs
        if new_round:
            speculate = self.should_speculate(num_seqs)
        else:
            speculate = self._last is None or bool(self._last.choice)
        if not speculate:
            return 0
        if self.hit_rate < self.min_hit_rate:
            self._paused_rounds += 1
            if self._paused_rounds % self.probe_every:
                return 0
        return self.width * num_seqs

    def should_speculate(self, num_seqs: int) -> bool:
        """Measure both choices first, then take the better one, now and then measuring
        the other again (conditions change: load, batch mix, a new draft)."""
        b = self._buckets.setdefault(batch_bucket(num_seqs), _Bucket())
        self._last = b
        if not b.measuring:
            missing = [c for c in (True, False) if c not in b.rates]
            if missing:
                self._switch(b, missing[0], measure=True)
                b.next_compare = b.rounds + self.compare_every
            else:
                best = b.rates[True] >= b.rates[False]
                if b.rounds >= b.next_compare:
                    self._switch(b, not best, measure=True)
                    b.next_compare = b.rounds + self.compare_every
                elif b.choice != best:
                    self._switch(b, best, measure=False)
        return bool(b.choice)

    def _switch(self, b: _Bucket, choice: bool, measure: bool) -> None:
        b.measuring, b.left = measure, self.compare_rounds
        if b.choice != choice:
            b.choice, b.skip = choice, True
            b.tokens = b.seconds = 0.0
            b.counted = 0

    def observe_round(self, tokens: int, seconds: float) -> None:
        """The round that ran under the last :meth:`budget` committed ``tokens`` in
        ``seconds`` (wall time of the round in the engine core)."""
        b = self._last
        if not self.adaptive or b is None or b.choice is None or seconds <= 0:
            return
        b.rounds += 1
        if b.measuring:
            b.left -= 1
        if b.skip:  # its drafts were prepared, or not, under the previous choice
            b.skip = False
        else:
            b.tokens = self.goodput_decay * b.tokens + tokens
            b.seconds = self.goodput_decay * b.seconds + seconds
            b.counted += 1
            if not b.measuring and b.counted >= 4:  # the running choice, kept up to date
                b.rates[b.choice] = b.tokens / b.seconds
        if b.measuring and b.left <= 0:
            if b.counted:
                b.rates[b.choice] = b.tokens / b.seconds
            b.measuring = False

    def goodput(self) -> dict[int, dict[str, float]]:
        """Measured tokens/s per batch bucket, with and without speculation (for stats)."""
        return {
            bucket: {("on" if c else "off"): round(r, 2) for c, r in b.rates.items()}
            for bucket, b in self._buckets.items()
        }

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


@dataclass
class _Domain:
    """Decayed acceptance counts of one traffic domain, and its probing state."""

    accepted: float = 0.0  # A: accepted draft tokens
    rejections: float = 0.0  # R: rounds that ended in a rejection
    choices: int = 0  # rounds this domain was asked about
    disabled_at: int | None = None  # its choice count when k = 0 was chosen
    probe_left: int = 0  # probe rounds still to run

    @property
    def tokens(self) -> float:
        return self.accepted + self.rejections

    def alpha(self) -> float:
        return self.accepted / self.tokens


class SpeculationLength:
    """The draft length k per domain and batch size, chosen for goodput (pure).

    Acceptance alone cannot decide whether to speculate: with acceptance flat, the best k
    falls to 0 as the batch grows because verification stops being memory-bound (on GPUs
    and on CPUs alike). So k maximises predicted committed tokens per second,
    ``E(k) / (k·T_d(b) + T_v(b, k + 1))`` (:func:`specdec.speedup.best_k`), from

    * ``α̂ = A / (A + R)`` per domain (decayed counts of accepted tokens and of rounds that
      hit a rejection: independent of k, unlike accepted/drafted), and
    * the measured costs of the batch size's bucket: a draft step, and verification at
      each number of positions per row seen so far (others interpolated linearly, or
      scaled from the nearest measured point).

    ``k = 0`` when no k is predicted to pay. A disabled domain is re-probed with
    ``probe_k`` for ``probe_rounds`` rounds every ``probe_every`` choices, so a domain
    whose traffic recovers gets speculation back while a losing one costs at most
    ``probe_rounds / probe_every`` of its rounds. A drift alert (:meth:`on_drift`)
    replaces the domain's history with the detector's recent estimate, so the next
    choice already reflects it. A request that sets its own k is not asked about.
    """

    def __init__(
        self,
        max_k: int,
        default_k: int,
        *,
        decay: float = 0.995,
        min_tokens: float = 32.0,
        probe_every: int = 256,
        probe_rounds: int = 8,
        probe_k: int = 1,
        cost_decay: float = 0.9,
    ):
        if not 0 <= default_k <= max_k or probe_k < 1 or probe_every < probe_rounds:
            raise ValueError(
                "need 0 <= default_k <= max_k, probe_k >= 1, probe_every >= probe_rounds"
            )
        self.max_k, self.default_k = max_k, default_k
        self.decay, self.min_tokens, self.cost_decay = decay, min_tokens, cost_decay
        self.probe_every, self.probe_rounds, self.probe_k = probe_every, probe_rounds, probe_k
        self._domains: dict[str, _Domain] = {}
        self._verify: dict[tuple[int, int], float] = {}  # (bucket, positions) -> seconds
        self._draft: dict[int, float] = {}  # bucket -> seconds per draft step

    # ----- observations -------------------------------------------------------------------

    def _ewma(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else self.cost_decay * old + (1 - self.cost_decay) * value

    def observe_verify(self, batch_size: int, positions: int, seconds: float) -> None:
        """A target pass over ``batch_size`` rows of ``positions`` tokens each took this."""
        self._ewma(self._verify, (batch_bucket(batch_size), positions), seconds)

    def observe_draft_step(self, batch_size: int, seconds: float) -> None:
        """One draft forward step over ``batch_size`` rows took this."""
        self._ewma(self._draft, batch_bucket(batch_size), seconds)

    def observe_round(self, domain: str, drafted: int, accepted: int) -> None:
        """One sequence's round: ``accepted`` of ``drafted`` drafts (a rejection if fewer)."""
        if drafted <= 0:
            return
        d = self._domains.setdefault(domain, _Domain())
        d.accepted = self.decay * d.accepted + accepted
        d.rejections = self.decay * d.rejections + (1.0 if accepted < drafted else 0.0)

    def on_drift(self, domain: str, current_alpha: float, weight: float | None = None) -> None:
        """A drift alert: forget the domain's history in favour of the recent estimate."""
        d = self._domains.setdefault(domain, _Domain())
        w = self.min_tokens if weight is None else weight
        d.accepted, d.rejections = current_alpha * w, (1.0 - current_alpha) * w

    def alpha(self, domain: str) -> float | None:
        d = self._domains.get(domain)
        return d.alpha() if d is not None and d.tokens >= self.min_tokens else None

    # ----- the decision -------------------------------------------------------------------

    def _verify_fn(self, bucket: int):
        measured = sorted((n, t) for (b, n), t in self._verify.items() if b == bucket)
        if not measured:
            return None

        def verify(n: int) -> float:
            below = [(m, t) for m, t in measured if m <= n]
            above = [(m, t) for m, t in measured if m >= n]
            if below and above:
                (n0, t0), (n1, t1) = below[-1], above[0]
                return t0 if n1 == n0 else t0 + (t1 - t0) * (n - n0) / (n1 - n0)
            m, t = below[-1] if below else above[0]
            return t * n / m if n > m else t  # past the data: cost grows with positions

        return verify

    def predicted_k(self, domain: str, batch_size: int) -> int:
        """The goodput-maximising k from what is measured (``default_k`` until then)."""
        alpha = self.alpha(domain)
        bucket = batch_bucket(batch_size)
        verify = self._verify_fn(bucket)
        if alpha is None or verify is None or bucket not in self._draft:
            return self.default_k
        return best_k(alpha, self._draft[bucket], verify, self.max_k)[0]

    def choose(self, domain: str, batch_size: int, requested: int | None = None) -> int:
        """k for one sequence's next round; ``requested`` (the request's own k) wins."""
        if requested is not None:
            return requested
        d = self._domains.setdefault(domain, _Domain())
        d.choices += 1
        if d.probe_left > 0:
            d.probe_left -= 1
            return self.probe_k
        k = self.predicted_k(domain, batch_size)
        if k > 0:
            d.disabled_at = None
            return k
        if d.disabled_at is None:
            d.disabled_at = d.choices
        elif d.choices - d.disabled_at >= self.probe_every:
            d.disabled_at = d.choices
            d.probe_left = self.probe_rounds - 1
            return self.probe_k
        return 0
