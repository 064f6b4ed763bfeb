"""SpeculationWidth: pure decisions, driven here by synthetic round outcomes."""

from specdec.policy import SpeculationWidth, batch_bucket


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
