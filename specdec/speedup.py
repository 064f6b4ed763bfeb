"""The speedup / goodput model of speculative decoding (docs/architecture.md, "Formulas").

With per-token acceptance probability ``α`` (assumed i.i.d. over positions, as in
Leviathan et al. 2023, https://arxiv.org/abs/2211.17192) and ``k`` draft tokens, a round
commits on average

    E(k) = (1 - α^(k+1)) / (1 - α)            tokens (accepted + recovered/bonus).

A sequential round costs ``k · T_d + T_v(k + 1)``; plain decoding costs ``T_t(1)`` per
token, so the speedup is ``S = E(k) · T_t(1) / (k · T_d + T_v(k + 1))``. When drafting
overlaps verification and the speculation cache hits with rate ``h``, the round costs
about ``T_v(k + 1) + (1 - h) · k · T_d``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from specdec.stats import alpha_hat


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E(k) = (1 - α^(k+1)) / (1 - α); equals k + 1 at α = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def sequential_round_time(k: int, t_draft: float, t_verify: float) -> float:
    """Draft k tokens one after the other, then verify k + 1 positions."""
    return k * t_draft + t_verify


def overlapped_round_time(k: int, t_draft: float, t_verify: float, hit_rate: float) -> float:
    """Drafting hidden behind verification on a speculation-cache hit (rate ``h``)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate}")
    return t_verify + (1.0 - hit_rate) * k * t_draft


def speedup(
    alpha: float,
    k: int,
    t_draft: float,
    t_verify: float,
    t_target: float,
    hit_rate: float | None = None,
) -> float:
    """S = E(k) · T_t(1) / round time (sequential, or overlapped when ``hit_rate`` is given)."""
    if hit_rate is None:
        round_time = sequential_round_time(k, t_draft, t_verify)
    else:
        round_time = overlapped_round_time(k, t_draft, t_verify, hit_rate)
    return expected_tokens_per_round(alpha, k) * t_target / round_time


def estimate_alpha(accepted_per_round: Iterable[int], drafted_per_round: Iterable[int]) -> float:
    """α̂ = ΣA_r / (ΣA_r + #rounds with a rejection).

    Each round is a run of Bernoulli(α) successes stopped by the first failure or by the
    draft length; this is the maximum-likelihood estimate under that censoring. The raw
    accepted/drafted ratio is biased low because positions after a rejection are never
    tested. Returns 0.0 with no evidence.
    """
    total, rejections = 0, 0
    for a, d in zip(accepted_per_round, drafted_per_round, strict=True):
        if d == 0:
            continue
        total += a
        rejections += int(a < d)
    alpha = alpha_hat(total, rejections)
    return 0.0 if alpha is None else alpha


def best_k(
    alpha: float,
    t_draft: float,
    t_verify_fn: Callable[[int], float],
    k_max: int = 10,
    hit_rate: float | None = None,
) -> tuple[int, float]:
    """The draft length that maximises goodput (tokens per second), and that goodput.

    ``t_verify_fn(n)`` is the measured cost of a target pass over ``n`` positions, so
    ``t_verify_fn(1)`` is plain decoding. ``k = 0`` (no speculation) is a candidate, so
    the answer is never predicted to be slower than plain decoding.
    """
    best, best_rate = 0, 1.0 / t_verify_fn(1)
    for k in range(1, k_max + 1):
        if hit_rate is None:
            round_time = sequential_round_time(k, t_draft, t_verify_fn(k + 1))
        else:
            round_time = overlapped_round_time(k, t_draft, t_verify_fn(k + 1), hit_rate)
        rate = expected_tokens_per_round(alpha, k) / round_time
        if rate > best_rate:
            best, best_rate = k, rate
    return best, best_rate


def break_even_alpha(k: int, cost_ratio: float, verify_ratio: float = 1.0) -> float:
    """The per-token acceptance at which ``k`` drafts per round give speedup exactly 1.

    With ``c = T_d / T_v(k + 1)`` (``cost_ratio``) and ``r = T_v(k + 1) / T_t(1)``
    (``verify_ratio``, 1 while verification is memory-bound), the sequential speedup is
    ``S = E(k) / (r · (1 + k·c))``, so break-even solves ``E(k) = r · (1 + k·c)``. ``E``
    rises from 1 at α = 0 to k + 1 at α = 1, so the root is unique: 0.0 when speculation
    pays at any acceptance, 1.0 when it never pays. For the overlapped pipeline with hit
    rate ``h`` pass ``(1 - h) · c``. Drift alerts use it as the level below which a domain
    loses time, not just acceptance.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if cost_ratio < 0.0 or verify_ratio <= 0.0:
        raise ValueError(
            f"need cost_ratio >= 0 and verify_ratio > 0, got {cost_ratio}, {verify_ratio}"
        )
    needed = verify_ratio * (1.0 + k * cost_ratio)  # tokens per round that pay for the round
    if needed <= 1.0:
        return 0.0
    if needed >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection to float precision: E(k) is increasing in α
        mid = 0.5 * (lo + hi)
        if expected_tokens_per_round(mid, k) < needed:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
