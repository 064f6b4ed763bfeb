"""Acceptance-drift detection per domain: a Bernoulli CUSUM on per-token acceptance.

A domain's acceptance drops when its traffic moves away from what the draft was trained
on (a tenant starts sending code to a chat draft). Engines only count acceptance; an
operator needs to be told, quickly and without pages for noise. This module is the pure
detector: numpy state per domain, no Ray, no OpenTelemetry (the monitor actor feeds it
batched round outcomes and turns its events into alerts).

**Observations.** A verification round with ``d`` drafts and ``a`` accepted is a censored
geometric run of per-token Bernoulli(α) outcomes: ``a`` ones, then one zero if ``a < d``
(no rejection is observed when ``a == d``). Its likelihood ``α^a (1 - α)^[a < d]``
depends on the data only through the accepted tokens ``A`` and the rejections ``R``, the
same sufficient statistics as ``α̂ = A / (A + R)`` (docs/architecture.md, "Formulas";
never the raw ratio).

**Test** (Page's CUSUM, https://doi.org/10.1093/biomet/41.1-2.100). In control
``α = α_0``, learned over a warm-up; out of control ``α = α_1 = max(break-even, α_0 - δ)``:
the acceptance at which speculation with the current ``k`` and measured costs stops
paying, or a drop of ``δ``, whichever is reached first. Each increment is the
log-likelihood ratio of a round's tokens, the sum of their Bernoulli ratios::

    llr = A · log(α_1 / α_0) + R · log((1 - α_1) / (1 - α_0))
    S   = max(0, S + llr),   fire when S >= h.

**Threshold.** ``exp(llr)`` has mean one under ``α_0``, so an excursion of ``S`` away
from 0 reaches ``h`` with probability at most ``e^-h`` (Wald); the CUSUM is a sequence of
such excursions, each at least one increment long, so the in-control average run length
is ``ARL_0 >= e^h`` increments (Lorden 1971), hence ``>= e^h`` rounds and tokens: we set
``h = log(target ARL in rounds)``. The bound is loose: at α = 0.75, k = 4, h = 12.2 the
measured rate is about one false alarm per 10^6 rounds, e^h is 2·10^5. It holds for any
``α_1`` fixed before the round it scores (``k`` and costs may change), but assumes
``α_0`` is the true baseline: a warm-up estimate that is high by chance shortens
``ARL_0``, which is why the warm-up is thousands of tokens.

**Dispersion.** The tokens of one request are not independent trials: a request's text
is easy or hard for the draft as a whole, so acceptance comes in clusters. On the demo's
Python traffic (drift draft, k = 4) the variance of acceptance over blocks of 64 to 1024
outcomes is 7 to 11 times the binomial one. A CUSUM that takes tokens as independent then
reads a run of hard requests as a drop: its real false-alarm bound is about ``e^(h/φ)``,
not ``e^h``, for a variance inflation ``φ``. The warm-up therefore also measures ``φ``:
it cuts the domain's rounds into ``dispersion_blocks`` blocks of consecutive outcomes (a
grid over the warm-up, whatever the sizes of the calls that brought them) and takes
Pearson's ``χ² / (blocks - 1)`` of the blocks' accepted counts against their pooled
acceptance, where Pearson's test rejects independent outcomes at 10 % (1 otherwise).
Every increment, of the fire and of the resolve test, is divided by ``φ`` (a
quasi-likelihood ratio). In the diffusion approximation a walk with drift ``-μ`` per
token and variance ``φ·v`` per token (``2μ ≈ v`` near the null) leaves 0 for ``h`` with
probability ``exp(-2μh / (φv))``; scaling the increments by ``1 / φ`` makes that
``exp(-h)`` again, so with a measured ``φ`` the bound on ``ARL_0`` is approximate.

The block count trades noise for bias: few long blocks see the clusters whole but
measure ``φ`` with ±25 % noise (32 blocks), which under-measures it for some domains
(false alarms) and, on independent traffic, slows detection; many short blocks cut
clusters and under-measure it. 96 blocks and the 10 % gate measured best on synthetic
streams (tests/monitoring/test_drift.py): on independent outcomes the iid detector's
figures hold (a drop 0.75 → 0.45 caught within 50 rounds in 96 % of streams); on
clustered ones (``φ`` about 1.8 to 5.5) 0 to 4 false alarms per 10^6 rounds, within the
bound's 5, against 2873 for the test that takes tokens as independent. Detection slows
by about ``φ``: a drop from 0.78 to 0.13 there is caught in a median 80 rounds, against
15.

**Granularity.** The rounds of one domain in one :meth:`DriftMonitor.observe` call form
one increment, clipped at 0 as a whole: one call costs a few numpy passes however many
domains it holds. Clipping per token (between a round's accepted tokens and its
rejection) could only make ``S`` larger; the pooled form is the conservative side and the
bound above holds for it.

**Resolve, with hysteresis.** While firing, a reverse CUSUM tests "still degraded" against
"back at ``α_0``" with the same kind of increments. Its null sits only part of the way
down (``α_r = α_0 - resolve_fraction · (α_0 - α_1)``), so between the level where the
forward test drifts up and the one where the reverse test does there is a dead band in
which neither moves: acceptance hovering near the alert level cannot make it flap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from specdec.speedup import break_even_alpha
from specdec.stats import alpha_hat

_ALPHA_MIN, _ALPHA_MAX = 1e-3, 1.0 - 1e-3  # keep the log-likelihood ratios finite
_DISPERSION_Z = 1.2816  # one-sided 10 %: dispersion is used where the warm-up shows it
_break_even = lru_cache(maxsize=4096)(break_even_alpha)  # (k, cost, verify) repeat a lot


class DriftState(str, Enum):
    """Where a domain's detector stands (RESOLVED monitors exactly like IN_CONTROL)."""

    WARMING_UP = "warming_up"
    IN_CONTROL = "in_control"
    FIRING = "firing"
    RESOLVED = "resolved"


_STATES = list(DriftState)  # the int8 codes in DriftMonitor._state index this
_WARMING, _IN_CONTROL, _FIRING, _RESOLVED = range(4)


class DriftConfig(BaseModel):
    """Parameters of the drift detector (the same schema in Python and serve YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup_tokens: int = Field(
        8000,
        ge=1,
        description="Per-token outcomes (accepted tokens + rejections, the denominator of "
        "alpha_hat) that learn a domain's baseline alpha_0 before it is monitored: about "
        "2900 rounds at alpha 0.75 and k 4. A short warm-up leaves a baseline that is high "
        "by chance often enough to cost false alarms.",
    )
    delta: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="Drop of per-token acceptance the test is tuned to: "
        "alpha_1 = max(break-even acceptance, alpha_0 - delta).",
    )
    target_arl_rounds: float = Field(
        2e5,
        gt=1.0,
        description="Lower bound on the in-control average run length, in rounds between "
        "false alarms: threshold h = log(target_arl_rounds) (ARL_0 >= e^h; exact for "
        "independent outcomes, approximate through the measured dispersion otherwise). "
        "The bound is loose: the default measures about 1e6 rounds at alpha 0.75, k 4.",
    )
    dispersion_blocks: int = Field(
        96,
        ge=0,
        description="Blocks of consecutive outcomes the warm-up is cut into to measure the "
        "variance inflation phi of acceptance (requests are easy or hard as a whole); "
        "every CUSUM increment is divided by phi (1 unless Pearson's test shows it at 10 "
        "%). Blocks should span several "
        "requests: warmup_tokens / dispersion_blocks outcomes each. 0: phi = 1 (outcomes "
        "taken as independent, which false-alarms on real traffic).",
    )
    max_dispersion: float = Field(
        100.0,
        ge=1.0,
        description="Upper bound on the measured phi (a warm-up with a shift inside it "
        "would otherwise make the detector blind).",
    )
    resolve_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="The resolve test's null sits this fraction of the way from alpha_0 "
        "down to alpha_1. 1 tests alpha_1 against alpha_0 (no hysteresis); smaller values "
        "need acceptance closer to the baseline to resolve.",
    )
    resolve_arl_rounds: float | None = Field(
        None,
        gt=1.0,
        description="Like target_arl_rounds, for the reverse (resolve) CUSUM; None: the same.",
    )
    cost_ratio: float = Field(
        0.0,
        ge=0.0,
        description="Draft step cost over target verify cost, T_d / T_v(k+1), for a k "
        "the serving engine has not measured yet (its length policy reports measured round "
        "times, which take precedence). 0: break-even is 0 and alerts follow delta.",
    )
    verify_ratio: float = Field(
        1.0,
        gt=0.0,
        description="T_v(k+1) / T_t(1), verify pass over plain decoding step, for a k "
        "without measured round times (1 while decoding is memory-bound).",
    )
    max_domains: int = Field(
        256,
        ge=1,
        description="Domains tracked by name; later ones share the overflow domain, so "
        "memory and alert cardinality stay bounded whatever clients send.",
    )
    overflow_domain: str = Field(
        "__overflow__", description="Name of the domain that pools domains past max_domains."
    )
    default_domain: str = Field("default", description="Domain of rounds that carry none.")

    @property
    def threshold(self) -> float:
        """h of the forward (fire) CUSUM, in nats."""
        return math.log(self.target_arl_rounds)

    @property
    def resolve_threshold(self) -> float:
        """h of the reverse (resolve) CUSUM, in nats."""
        return math.log(self.resolve_arl_rounds or self.target_arl_rounds)


@dataclass(frozen=True)
class DriftEvent:
    """A domain's alert fired (acceptance dropped) or resolved (it came back)."""

    kind: Literal["fire", "resolve"]
    domain: str
    baseline: float  # alpha_0, learned over the warm-up
    current: float  # alpha_hat over `rounds`
    rounds: int  # rounds since the CUSUM last left 0: since the estimated change point
    break_even: float  # acceptance at which speculation with `k` drafts gives speedup 1
    k: int  # draft length of the domain's latest rounds (the largest in their call)
    alternative: float  # alpha_1, the level the fire test was tuned to
    below_break_even: bool  # break_even >= alpha_0: the domain loses time even in control
    dispersion: float = 1.0  # phi, the variance inflation every increment was divided by


@dataclass(frozen=True)
class DomainStatus:
    """A snapshot of one domain's detector (for stats endpoints and dashboards)."""

    domain: str
    state: DriftState
    baseline: float | None  # None while warming up
    alternative: float | None
    break_even: float
    below_break_even: bool
    k: int
    statistic: float  # S of the running test: reverse while firing, forward otherwise
    threshold: float
    rounds: int  # rounds since that statistic last left 0
    current: float | None  # alpha_hat over those rounds (None: no evidence)
    warmup_seen: int  # tokens learnt into the baseline so far
    dispersion: float | None  # phi learnt with the baseline (None while warming up)


def llr_coefficients(alpha0, alpha1):
    """Log-likelihood ratio of ``α_1`` against ``α_0`` per accepted token and per rejection.

    Works on scalars and arrays alike; an increment is ``A · l_accept + R · l_reject``.
    """
    alpha0, alpha1 = np.asarray(alpha0, float), np.asarray(alpha1, float)
    return np.log(alpha1 / alpha0), np.log((1.0 - alpha1) / (1.0 - alpha0))


def cusum_step(s, accepted, rejections, l_accept, l_reject):
    """``S = max(0, S + A · l_accept + R · l_reject)``, elementwise (all shapes [slots])."""
    return np.maximum(0.0, s + accepted * l_accept + rejections * l_reject)


def alternative_alpha(alpha0: float, break_even: float, delta: float) -> tuple[float, bool]:
    """``α_1`` and whether the domain is below break-even even in control.

    ``α_1`` must stay below ``α_0`` for the test to mean "dropped": where break-even is
    at or above ``α_0`` the domain already loses time, which is flagged, and the test falls
    back to a drop of ``delta``.
    """
    below = break_even >= alpha0
    alpha1 = alpha0 - delta if below else max(break_even, alpha0 - delta)
    return max(alpha1, _ALPHA_MIN), below


def chi2_upper(df, z: float = _DISPERSION_Z):
    """Upper quantile of χ² with ``df`` degrees of freedom at standard normal ``z``
    (Wilson–Hilferty: ``df (1 - 2 / (9 df) + z sqrt(2 / (9 df)))³``, within 1 % of the
    exact quantile from 10 degrees of freedom on)."""
    c = 2.0 / (9.0 * np.asarray(df, float))
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def dispersion(sums) -> np.ndarray:
    """Variance inflation of acceptance: Pearson's ``χ² / (blocks - 1)`` of blocks'
    accepted counts where it shows overdispersion, 1 where it does not.

    ``sums[..., :]`` = (blocks, Σ A_b, Σ n_b, Σ A_b² / n_b) over closed blocks of ``n_b``
    outcomes with ``A_b`` accepted. With ``α = Σ A / Σ n`` the statistic is
    ``Σ (A_b - α n_b)² / n_b / (α (1 - α))``, which expands to ``(Σ A_b² / n_b - α Σ
    A_b) / (α (1 - α))``. It is used only when it exceeds the one-sided 10 % quantile of
    ``χ²(blocks - 1)``, the law it has when outcomes are independent: otherwise its noise
    (±15 % at 96 blocks) would slow detection on traffic that has no clusters. Fewer than
    two blocks, or α at 0 or 1: 1.
    """
    sums = np.asarray(sums, float)
    blocks, acc, n, sq = np.moveaxis(sums, -1, 0)
    df = blocks - 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = acc / n
        chi2 = (sq - alpha * acc) / (alpha * (1.0 - alpha))
        shown = chi2 > chi2_upper(df)
    ok = (blocks >= 2) & (alpha > 0.0) & (alpha < 1.0) & np.isfinite(chi2) & shown
    return np.where(ok, np.maximum(chi2 / np.where(ok, df, 1.0), 1.0), 1.0)


class DriftMonitor:
    """CUSUM drift detectors for many domains, updated together from batched rounds.

    State lives in arrays of shape ``[max_domains + 1]`` (the last slot is the overflow
    domain), so :meth:`observe` costs a few numpy passes per call, not per round.
    """

    def __init__(self, config: DriftConfig | None = None) -> None:
        self.config = cfg = config or DriftConfig()
        n = cfg.max_domains + 1
        self._slot_of: dict[str, int] = {cfg.overflow_domain: n - 1}
        self._names = [""] * (n - 1) + [cfg.overflow_domain]  # slot -> domain
        self._h, self._h_rev = cfg.threshold, cfg.resolve_threshold
        self._state = np.zeros(n, np.int8)  # codes of _STATES
        self._k = np.zeros(n, np.int64)  # drafts per round, latest rounds
        self._cost = np.full(n, cfg.cost_ratio)  # T_d / T_v(k+1)
        self._verify = np.full(n, cfg.verify_ratio)  # T_v(k+1) / T_t(1)
        self._measured: dict[int, dict[int, float]] = {}  # slot -> {k: T(k) / T(0)}
        self._warm = np.zeros((n, 2))  # [slot, (accepted, rejections)] during warm-up
        # [slot, (accepted, outcomes, grid index)] of the open block (_fill_blocks)
        self._block = np.zeros((n, 3))
        self._blocks = np.zeros((n, 4))  # [slot, (blocks, ΣA_b, Σn_b, ΣA_b²/n_b)] closed
        self._phi = np.ones(n)  # variance inflation the increments are divided by
        self._alpha0 = np.zeros(n)
        self._alpha1 = np.zeros(n)
        self._break_even = np.zeros(n)
        self._below = np.zeros(n, bool)
        self._l_acc = np.zeros(n)  # forward llr per accepted token / per rejection
        self._l_rej = np.zeros(n)
        self._r_acc = np.zeros(n)  # reverse llr, same units
        self._r_rej = np.zeros(n)
        self._s = np.zeros(n)  # forward CUSUM, nats
        self._s_rev = np.zeros(n)  # reverse CUSUM, nats (runs only while firing)
        self._run = np.zeros((n, 3))  # [slot, (rounds, accepted, rejections)] since S left 0
        self._rev_run = np.zeros((n, 3))  # the same for the reverse CUSUM
        self._relearn = np.zeros(n, bool)  # firing at a draft swap: new baseline on resolve

    # -- domains ---------------------------------------------------------------------

    @property
    def domains(self) -> list[str]:
        """Tracked domain names (the overflow domain included)."""
        return list(self._slot_of)

    def _slot(self, domain: str | None) -> int:
        if domain is None:
            domain = self.config.default_domain
        slot = self._slot_of.get(domain)
        if slot is None:
            slot = len(self._slot_of) - 1  # named slots in use (overflow is in the dict)
            if slot >= self.config.max_domains:
                return len(self._names) - 1
            self._slot_of[domain] = slot
            self._names[slot] = domain
        return slot

    def _known(self, domain: str) -> int:
        if domain not in self._slot_of:
            raise KeyError(f"unknown drift domain {domain!r}")
        return self._slot_of[domain]

    # -- updates ---------------------------------------------------------------------

    def observe(
        self,
        domains: str | Sequence[str | None] | None,
        drafted,
        accepted,
    ) -> list[DriftEvent]:
        """Feed verification rounds; returns the alerts that fired or resolved.

        ``drafted[i]`` and ``accepted[i]`` are round ``i``'s draft and accepted counts
        (shape [rounds]); ``domains`` names each round's domain, or is one name for all.
        Rounds without drafts (speculation off) carry no evidence and are skipped.
        """
        drafted = np.atleast_1d(np.asarray(drafted, dtype=np.int64))  # [rounds]
        accepted = np.atleast_1d(np.asarray(accepted, dtype=np.int64))  # [rounds]
        if drafted.ndim != 1 or drafted.shape != accepted.shape:
            raise ValueError(f"need equal 1-d shapes, got {drafted.shape}, {accepted.shape}")
        if ((accepted < 0) | (accepted > drafted)).any():
            raise ValueError("need 0 <= accepted <= drafted in every round")
        slots = self._slots(domains, len(drafted))  # [rounds]
        keep = drafted > 0
        if not keep.all():
            slots, drafted, accepted = slots[keep], drafted[keep], accepted[keep]

        n = len(self._names)
        stats = np.empty((n, 3))  # [slot, (rounds, accepted tokens, rejections)]
        stats[:, 0] = np.bincount(slots, minlength=n)
        stats[:, 1] = np.bincount(slots, accepted, minlength=n)
        rejected = accepted < drafted  # [rounds] the round ended in a rejection
        stats[:, 2] = np.bincount(slots, rejected.astype(float), minlength=n)
        touched = stats[:, 0] > 0
        k = np.zeros(n, np.int64)  # [slot] drafts per round, this call
        np.maximum.at(k, slots, drafted)

        state = self._state.copy()  # the states this call's rounds are scored under
        for slot in np.flatnonzero(touched & (k != self._k)):  # rare: k moved
            self._k[slot] = k[slot]
            self._refresh(slot)

        warming = touched & (state == _WARMING)
        if warming.any():
            outcomes = accepted + rejected  # [rounds] per-token outcomes
            self._learn(warming, stats, slots, accepted, outcomes)

        fwd = touched & ((state == _IN_CONTROL) | (state == _RESOLVED))
        rev = touched & (state == _FIRING)
        return self._test_fire(fwd, stats) + self._test_resolve(rev, stats)

    def _test_fire(self, fwd: np.ndarray, stats: np.ndarray) -> list[DriftEvent]:
        """The forward CUSUM of the monitored slots in ``fwd`` ([slots] bool): alerts
        that fire; a firing slot's reverse test starts from 0."""
        events: list[DriftEvent] = []
        if not fwd.any():
            return events
        self._s, self._run = self._advance(fwd, stats, self._s, self._run, self._l_acc, self._l_rej)
        for slot in np.flatnonzero(fwd & (self._s >= self._h)):
            events.append(self._event("fire", slot, self._run[slot]))
            self._state[slot] = _FIRING
            self._s[slot], self._run[slot] = 0.0, 0.0
            self._s_rev[slot], self._rev_run[slot] = 0.0, 0.0
        return events

    def _test_resolve(self, rev: np.ndarray, stats: np.ndarray) -> list[DriftEvent]:
        """The reverse CUSUM of the firing slots in ``rev`` ([slots] bool): alerts that
        resolve; one firing since a draft swap then learns its baseline again."""
        events: list[DriftEvent] = []
        if not rev.any():
            return events
        self._s_rev, self._rev_run = self._advance(
            rev, stats, self._s_rev, self._rev_run, self._r_acc, self._r_rej
        )
        for slot in np.flatnonzero(rev & (self._s_rev >= self._h_rev)):
            events.append(self._event("resolve", slot, self._rev_run[slot]))
            self._state[slot] = _RESOLVED
            self._s[slot], self._run[slot] = 0.0, 0.0
            if self._relearn[slot]:  # back, on a draft the baseline was not learnt on
                self._reset([slot])
        return events

    def _learn(self, warming: np.ndarray, stats: np.ndarray, slots, accepted, outcomes) -> None:
        """A call's rounds into the warm-up of the slots in ``warming`` ([slots] bool):
        the baseline's counts and the dispersion's blocks (``slots``, ``accepted`` and
        ``outcomes`` per round, [rounds]); a slot whose warm-up is complete is monitored
        from its next call on."""
        cfg = self.config
        if cfg.dispersion_blocks:
            on = warming[slots]  # [rounds] rounds of warming slots
            self._fill_blocks(slots[on], accepted[on], outcomes[on])
        self._warm[warming] += stats[warming, 1:]
        done = warming & (self._warm.sum(1) >= cfg.warmup_tokens)
        for slot in np.flatnonzero(done):
            acc, rej = self._warm[slot]
            alpha0 = alpha_hat(acc, rej)  # never None: warmup_tokens >= 1 were seen
            self._alpha0[slot] = min(max(alpha0, 2 * _ALPHA_MIN), _ALPHA_MAX)
            self._phi[slot] = min(float(dispersion(self._blocks[slot])), cfg.max_dispersion)
            self._state[slot] = _IN_CONTROL
            self._refresh(slot)

    def _fill_blocks(self, slots, accepted, outcomes) -> None:
        """Rounds (in their order, [rounds] each) into their slots' blocks. Block ``j`` of
        a slot holds the rounds that start in ``[j, j + 1) · size`` of its warm-up's
        outcomes (size: ``warmup_tokens / dispersion_blocks``), a grid that does not
        depend on how rounds were split into calls (a busy replica's flush holds many
        blocks' worth of rounds); a block closes when a round starts past it, and the one
        open when the warm-up ends is left out. Call before the rounds reach ``_warm``."""
        if not len(slots):
            return
        size = self.config.warmup_tokens / self.config.dispersion_blocks  # outcomes
        order = np.argsort(slots, kind="stable")  # by slot, rounds in order within one
        s, a, n = slots[order], accepted[order].astype(float), outcomes[order].astype(float)
        ends = np.cumsum(n)  # [rounds] outcomes up to each round's end, all slots
        first = np.r_[True, s[1:] != s[:-1]]  # a slot's first round in this call
        base = np.maximum.accumulate(np.where(first, ends - n, 0.0))  # ends before the slot
        start = self._warm[s].sum(1) + (ends - n - base)  # [rounds] outcomes before it
        blk = (start // size).astype(np.int64)  # [rounds] grid index of its block
        lo = int(blk.min())
        width = int(blk.max()) - lo + 1
        keys, inv = np.unique(s * width + (blk - lo), return_inverse=True)  # sorted
        acc, tot = np.bincount(inv, a), np.bincount(inv, n)  # [keys]
        key_slot, key_blk = keys // width, keys % width + lo
        head = np.r_[True, key_slot[1:] != key_slot[:-1]]  # a slot's first block this call
        cont = head & (key_blk == self._block[key_slot, 2])  # it continues the open one
        acc[cont] += self._block[key_slot[cont], 0]
        tot[cont] += self._block[key_slot[cont], 1]
        # Open blocks that no round of this call continues close now (when not empty).
        gone = key_slot[head & ~cont]
        gone = gone[self._block[gone, 1] > 0]
        self._close(gone, self._block[gone, 0], self._block[gone, 1])
        last = np.r_[key_slot[1:] != key_slot[:-1], True]  # a slot's last block: open
        self._close(key_slot[~last], acc[~last], tot[~last])
        self._block[key_slot[last]] = np.stack([acc, tot, key_blk], 1)[last]

    def _close(self, slots, acc, tot) -> None:
        """Closed blocks (accepted ``acc``, outcomes ``tot``; [blocks] each) into their
        slots' dispersion sums."""
        rows = np.stack([np.ones_like(tot), acc, tot, acc * acc / tot], 1)
        np.add.at(self._blocks, slots, rows)

    def _slots(self, domains: str | Sequence[str | None] | None, count: int) -> np.ndarray:
        """Slot of each round ([count]); registers new domains up to the limit."""
        if domains is None or isinstance(domains, str):
            return np.full(count, self._slot(domains), np.intp)
        if len(domains) != count:
            raise ValueError(f"{len(domains)} domains for {count} rounds")
        try:  # fast path: every domain already tracked by name
            return np.fromiter(map(self._slot_of.__getitem__, domains), np.intp, count)
        except KeyError:  # new, past the limit, or None
            return np.fromiter(map(self._slot, domains), np.intp, count)

    @staticmethod
    def _advance(mask, stats, s, run, l_acc, l_rej):
        """One CUSUM increment for the slots in ``mask``; the run restarts where S is 0."""
        new = cusum_step(s, stats[:, 1], stats[:, 2], l_acc, l_rej)  # [slots]
        new_run = np.where((new > 0.0)[:, None], run + stats, 0.0)  # [slots, 3]
        return np.where(mask, new, s), np.where(mask[:, None], new_run, run)

    def set_costs(
        self, cost_ratio: float, *, verify_ratio: float = 1.0, domain: str | None = None
    ) -> None:
        """Measured costs moved (``T_d / T_v(k+1)``, ``T_v(k+1) / T_t(1)``): recompute
        break-even and ``α_1`` for one domain, or for all when ``domain`` is None."""
        if cost_ratio < 0.0 or verify_ratio <= 0.0:
            raise ValueError("need cost_ratio >= 0 and verify_ratio > 0")
        slots = range(len(self._names)) if domain is None else [self._slot(domain)]
        for slot in slots:
            self._cost[slot], self._verify[slot] = cost_ratio, verify_ratio
            self._refresh(slot)

    def set_round_time_ratios(self, domain: str, ratios: Mapping[int, float]) -> None:
        """Measured round times of the domain's serving engine, ``T(k) / T(0)`` per k
        (the length policy's measurements): break-even at k is then ``E(α, k) = T(k) /
        T(0)``, and these take precedence over the configured cost ratios for the ks they
        cover. Changes under 1 % are ignored."""
        clean = {
            int(k): float(r)
            for k, r in ratios.items()
            if int(k) >= 1 and math.isfinite(r) and r > 0
        }
        slot = self._slot(domain)
        old = self._measured.get(slot, {})
        if old.keys() == clean.keys() and all(abs(clean[k] / old[k] - 1) < 0.01 for k in old):
            return  # within 1 %: measurement noise, not worth moving the hypothesis
        self._measured[slot] = clean
        self._refresh(slot)

    def _refresh(self, slot: int) -> None:
        """Break-even, ``α_1`` and both tests' llr coefficients of a monitored slot."""
        if self._state[slot] == _WARMING or self._k[slot] < 1:
            return
        alpha0 = float(self._alpha0[slot])
        k = int(self._k[slot])
        measured = self._measured.get(slot, {}).get(k)
        if measured is not None:  # cost folded into the measured round time
            be = _break_even(k, 0.0, round(measured, 3))
        else:
            be = _break_even(k, float(self._cost[slot]), float(self._verify[slot]))
        alpha1, below = alternative_alpha(alpha0, be, self.config.delta)
        alpha_r = alpha0 - self.config.resolve_fraction * (alpha0 - alpha1)  # resolve null
        self._break_even[slot], self._alpha1[slot], self._below[slot] = be, alpha1, below
        phi = self._phi[slot]  # quasi-likelihood: increments over the variance inflation
        self._l_acc[slot], self._l_rej[slot] = np.divide(llr_coefficients(alpha0, alpha1), phi)
        self._r_acc[slot], self._r_rej[slot] = np.divide(llr_coefficients(alpha_r, alpha0), phi)

    # -- operator actions --------------------------------------------------------------

    def acknowledge(self, domain: str) -> None:
        """The operator accepts the domain's new acceptance as normal: learn it again.

        No resolve event follows: the operator closed the alert, the sink knows it.
        """
        self._reset([self._known(domain)])

    def rebaseline_all(self) -> None:
        """A new draft was deployed: every baseline is stale, all domains warm up again."""
        self._reset(slice(None))

    def new_draft(self) -> None:
        """New draft weights serve (an adapted version): domains not firing learn their
        baseline again on it; a firing domain stays firing until its acceptance is back
        (the reverse test against the baseline it fell from: the alert resolves when the
        new draft won the acceptance back, not because a draft was swapped), then learns
        its baseline on the new draft."""
        firing = self._state == _FIRING
        self._reset(~firing)
        self._relearn |= firing

    def _reset(self, slots) -> None:
        self._state[slots] = _WARMING
        self._warm[slots] = 0.0
        self._block[slots], self._blocks[slots], self._phi[slots] = 0.0, 0.0, 1.0
        self._s[slots], self._s_rev[slots] = 0.0, 0.0
        self._run[slots], self._rev_run[slots] = 0.0, 0.0
        self._alpha0[slots], self._alpha1[slots] = 0.0, 0.0
        self._below[slots] = False
        self._relearn[slots] = False

    # -- reading -----------------------------------------------------------------------

    def status(self, domain: str) -> DomainStatus:
        """A snapshot of one tracked domain (KeyError for a domain never seen)."""
        slot = self._known(domain)
        state = _STATES[self._state[slot]]
        firing = state is DriftState.FIRING
        run = self._rev_run[slot] if firing else self._run[slot]
        monitored = state is not DriftState.WARMING_UP
        return DomainStatus(
            domain=domain,
            state=state,
            baseline=float(self._alpha0[slot]) if monitored else None,
            alternative=float(self._alpha1[slot]) if monitored else None,
            break_even=float(self._break_even[slot]),
            below_break_even=bool(self._below[slot]),
            k=int(self._k[slot]),
            statistic=float(self._s_rev[slot] if firing else self._s[slot]),
            threshold=self._h_rev if firing else self._h,
            rounds=int(run[0]),
            current=alpha_hat(float(run[1]), float(run[2])),
            warmup_seen=int(self._warm[slot].sum()),
            dispersion=float(self._phi[slot]) if monitored else None,
        )

    def _event(self, kind: Literal["fire", "resolve"], slot: int, run) -> DriftEvent:
        return DriftEvent(
            kind=kind,
            domain=self._names[slot],
            baseline=float(self._alpha0[slot]),
            current=alpha_hat(float(run[1]), float(run[2])) or 0.0,
            rounds=int(run[0]),
            break_even=float(self._break_even[slot]),
            k=int(self._k[slot]),
            alternative=float(self._alpha1[slot]),
            below_break_even=bool(self._below[slot]),
            dispersion=float(self._phi[slot]),
        )
