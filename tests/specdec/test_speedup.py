import pytest

from specdec.speedup import (
    best_k,
    break_even_alpha,
    estimate_alpha,
    expected_tokens_per_round,
    overlapped_round_time,
    speedup,
)


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError):
        expected_tokens_per_round(1.5, 2)


def test_estimate_alpha_is_censored_mle():
    # Rounds: 2 of 4 accepted (rejection), 4 of 4 (no rejection), 0 of 4 (rejection).
    assert estimate_alpha([2, 4, 0], [4, 4, 4]) == pytest.approx(6 / (6 + 2))
    assert estimate_alpha([], []) == 0.0
    assert estimate_alpha([0], [0]) == 0.0  # rounds without drafts carry no evidence


def test_speedup_and_overlap():
    # alpha=0.8, k=4: E = (1 - 0.8^5) / 0.2 = 3.3616
    s = speedup(0.8, 4, t_draft=1.0, t_verify=12.0, t_target=10.0)
    assert s == pytest.approx(3.3616 * 10 / 16)
    assert overlapped_round_time(4, 1.0, 12.0, hit_rate=1.0) == 12.0
    assert speedup(0.8, 4, 1.0, 12.0, 10.0, hit_rate=1.0) > s


def test_best_k_trades_acceptance_against_cost():
    def verify(n):
        return 10.0 + 0.5 * (n - 1)

    k_high, _ = best_k(0.9, 1.0, verify)
    k_low, _ = best_k(0.5, 1.0, verify)
    assert k_high > k_low >= 1
    # Acceptance too low for the draft cost: no speculation.
    assert best_k(0.05, 5.0, verify) == (0, pytest.approx(0.1))


def test_break_even_alpha_gives_speedup_one():
    # c = T_d / T_v = 0.1, k = 4, memory-bound verify (T_v(k+1) = T_t(1)): E(4) = 1.4.
    alpha = break_even_alpha(4, 0.1)
    assert speedup(alpha, 4, t_draft=1.2, t_verify=12.0, t_target=12.0) == pytest.approx(1.0)
    assert (
        speedup(alpha + 0.01, 4, 1.2, 12.0, 12.0) > 1.0 > speedup(alpha - 0.01, 4, 1.2, 12.0, 12.0)
    )
    # A verify pass dearer than a plain step (r = 1.2) raises the bar.
    assert break_even_alpha(4, 0.1, verify_ratio=1.2) > alpha
    assert break_even_alpha(4, 0.0) == 0.0  # free drafts pay at any acceptance
    assert break_even_alpha(4, 1.0) == 1.0  # drafting costs a verify: never pays
    with pytest.raises(ValueError):
        break_even_alpha(0, 0.1)
