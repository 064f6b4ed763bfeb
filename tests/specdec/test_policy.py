"""SpeculationWidth and SpeculationLength: pure decisions, driven by synthetic outcomes."""

import random

import pytest

from specdec.policy import SpeculationLength, SpeculationWidth, batch_bucket
from specdec.speedup import best_k


def run_rounds(policy, num_seqs, rounds, rate_on, rate_off, tokens=4):
    """Feed ``rounds`` rounds whose goodput depends on whether the policy speculated."""
    choices = []
    for _ in range(rounds):
        on = policy.budget(num_seqs) > 0
        choices.append(on)
        rate = rate_on if on else rate_off
        policy.observe_round(tokens * num_seqs, tokens * num_seqs / rate)
    return choices


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 16, 31)] == [1, 2, 2, 3, 3, 4, 5, 5]


def test_keeps_speculating_where_it_pays():
    policy = SpeculationWidth(4)
    choices = run_rounds(policy, 1, 400, rate_on=150.0, rate_off=100.0)
    assert sum(choices[50:]) / len(choices[50:]) > 0.9  # only the re-measurements are off
    assert policy.goodput()[1]["on"] > policy.goodput()[1]["off"]


def test_stops_speculating_where_it_costs_and_per_batch_size():
    policy = SpeculationWidth(4)
    small = run_rounds(policy, 1, 300, rate_on=150.0, rate_off=100.0)
    large = run_rounds(policy, 16, 300, rate_on=300.0, rate_off=400.0)
    assert sum(large[50:]) / len(large[50:]) < 0.1
    assert sum(small[50:]) / len(small[50:]) > 0.9  # the small bucket kept its choice
    again = run_rounds(policy, 1, 50, rate_on=150.0, rate_off=100.0)
    assert sum(again) / len(again) > 0.9


def test_recovers_when_conditions_change():
    """A choice that became the worse one is dropped after the next re-measurement."""
    policy = SpeculationWidth(4, compare_every=100)
    run_rounds(policy, 1, 200, rate_on=150.0, rate_off=100.0)
    later = run_rounds(policy, 1, 400, rate_on=80.0, rate_off=100.0)
    assert sum(later[-150:]) / 150 < 0.1


def test_not_adaptive_always_speculates_at_full_width():
    policy = SpeculationWidth(3, adaptive=False)
    assert all(run_rounds(policy, 2, 50, rate_on=1.0, rate_off=100.0))
    assert policy.budget(2) == 6


def test_width_follows_overruns():
    policy = SpeculationWidth(4)
    policy.observe_speculation(0.010, 0.012, cut=True)
    assert policy.width == 3
    policy.observe_speculation(0.002, 0.012, cut=False)
    assert policy.width == 4


def _costs(policy, batch_size, draft_s, verify):
    """Feed measured costs: ``verify(batch, positions)`` seconds for 1..max_k + 1 positions."""
    for n in range(1, policy.max_k + 2):
        policy.observe_verify(batch_size, n, verify(batch_size, n))
    policy.observe_draft_step(batch_size, draft_s)


def _feed(policy, domain, alpha, rounds, k=4, seed=0):
    rng = random.Random(seed)
    for _ in range(rounds):
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        policy.observe_round(domain, k, a)


def test_length_follows_acceptance_and_turns_off_when_nothing_pays():
    policy = SpeculationLength(max_k=8, default_k=4)
    _costs(policy, 1, draft_s=0.1, verify=lambda b, n: 1.0 + 0.02 * n)  # memory-bound
    assert policy.predicted_k("code", 1) == 4  # nothing measured yet: the default
    _feed(policy, "code", 0.9, 400)
    _feed(policy, "prose", 0.1, 400)
    assert policy.alpha("code") == pytest.approx(0.9, abs=0.05)
    assert policy.choose("code", 1) >= 5
    assert policy.choose("prose", 1) == 0
    assert policy.choose("prose", 1, requested=3) == 3  # a request's own k wins


def test_length_falls_with_batch_size_at_constant_acceptance():
    """Verification turns compute-bound as the batch grows: the same acceptance that pays
    at batch 1 stops paying at batch 32 (the flip measured over HTTP: 1.51x at 1, 0.87x at 16)."""
    policy = SpeculationLength(max_k=8, default_k=4)

    def verify(b, n):  # fixed cost + work proportional to the tokens in the pass
        return 1.0 + 0.1 * b * n

    for b in (1, 4, 32):
        _costs(policy, b, draft_s=0.08 * (1 + 0.1 * b), verify=verify)
    _feed(policy, "code", 0.7, 600)
    ks = [policy.predicted_k("code", b) for b in (1, 4, 32)]
    assert ks[0] > ks[1] > ks[2] == 0, ks


def test_disabled_domain_is_reprobed_at_a_bounded_rate_and_recovers():
    policy = SpeculationLength(max_k=6, default_k=3, probe_every=100, probe_rounds=5)
    _costs(policy, 1, draft_s=0.15, verify=lambda b, n: 1.0 + 0.05 * n)
    _feed(policy, "d", 0.05, 500)
    choices = [policy.choose("d", 1) for _ in range(1000)]
    probes = sum(1 for k in choices if k > 0)
    assert 0 < probes <= (1000 // 100 + 1) * 5  # speculation costs at most 5 % of rounds
    assert set(choices) == {0, policy.probe_k}
    # Traffic recovers: the probes' rounds carry the news, and speculation comes back.
    got = []
    for _ in range(2000):
        k = policy.choose("d", 1)
        got.append(k)
        if k:
            _feed(policy, "d", 0.95, 1, k=k, seed=len(got))
        if k > policy.probe_k:
            break
    assert got[-1] > policy.probe_k, "speculation did not come back"


def test_a_drift_alert_changes_the_choice_at_once():
    policy = SpeculationLength(max_k=8, default_k=4)
    _costs(policy, 1, draft_s=0.2, verify=lambda b, n: 1.0 + 0.02 * n)
    _feed(policy, "d", 0.9, 2000)
    before = policy.choose("d", 1)
    policy.on_drift("d", current_alpha=0.2)
    after = policy.choose("d", 1)
    assert before >= 4 and after < before
    assert policy.alpha("d") == pytest.approx(0.2)


def test_a_wrong_goodput_model_would_be_caught():
    """Power check: a policy that ignored verification cost (picking k from acceptance
    alone) would keep k at batch 32; the goodput policy does not."""
    policy = SpeculationLength(max_k=8, default_k=4)
    _costs(policy, 32, draft_s=0.4, verify=lambda b, n: 1.0 + 0.05 * b * n)
    _feed(policy, "code", 0.75, 600)
    acceptance_only = best_k(0.75, 0.0, lambda n: 1.0, 8)[0]
    assert acceptance_only == 8 and policy.predicted_k("code", 32) == 0
