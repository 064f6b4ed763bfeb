"""SpeculationGate, and the length policy under it: pure decisions, synthetic engines."""

import pytest

from specdec.policy import LengthPolicyConfig, SpeculationLength, batch_bucket
from specdec.speculation_gate import GateConfig, SpeculationGate
from tests.specdec.test_policy import simulate


def gate_rounds(gate, bucket, rounds, rate_on, rate_off, tokens=16):
    """Rounds whose wall goodput depends on whether the gate let them draft."""
    choices = []
    for _ in range(rounds):
        on = gate.is_open(bucket)
        choices.append(on)
        gate.observe(bucket, on, tokens, tokens / (rate_on if on else rate_off))
    return choices


def test_stays_open_where_drafting_pays_and_closes_where_it_loses_per_bucket():
    gate = SpeculationGate()
    small = gate_rounds(gate, 1, 600, rate_on=300.0, rate_off=160.0)
    large = gate_rounds(gate, 5, 600, rate_on=900.0, rate_off=1000.0)
    assert sum(small[50:]) / len(small[50:]) > 0.9  # closed only to re-measure
    assert sum(large[50:]) / len(large[50:]) < 0.1  # open only to re-measure
    assert gate.rates()[(5, False)]["off"] > gate.rates()[(5, False)]["on"]
    again = gate_rounds(gate, 1, 100, rate_on=300.0, rate_off=160.0)
    assert sum(again) / len(again) > 0.9  # the small bucket kept its choice


def test_follows_a_change_within_a_comparison():
    config = GateConfig(compare_every=100, max_compare_every=100)
    gate = SpeculationGate(config)
    gate_rounds(gate, 3, 300, rate_on=500.0, rate_off=400.0)
    later = gate_rounds(gate, 3, 400, rate_on=350.0, rate_off=400.0)
    # open only to re-measure: compare_rounds in 100
    assert sum(later[-200:]) / 200 <= config.compare_rounds / 100


def test_rounds_count_as_what_they_did_not_what_was_planned():
    """An open gate whose rounds drafted nothing (the length policy chose 0) measured
    no speculation: its rate is the no-drafting one."""
    gate = SpeculationGate()
    for _ in range(20):
        assert gate.is_open(2)
        gate.observe(2, False, 10, 0.05)
    assert gate.rates()[(2, False)] == {"off": 200.0}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="compare_rounds"):
        GateConfig(compare_rounds=4, min_rounds=4)  # a trial would never yield a figure


def test_a_trial_nobody_observed_leaves_the_gate_open_until_the_next_comparison():
    """Rounds whose lengths other rows set are not observed: a trial of k = 0 that saw
    none of its rounds is not repeated at once (which would hold the policy's rows at
    k = 0 without ever measuring anything)."""
    gate = SpeculationGate(GateConfig(compare_rounds=6, min_rounds=4, compare_every=100))
    for _ in range(4):
        assert gate.is_open(1)
        gate.observe(1, True, 5, 0.01)
    choices = [gate.is_open(1) for _ in range(100)]  # nothing observed meanwhile
    assert choices[:6] == [False] * 6 and all(choices[6:])


def cost(b, k):  # CPU-like: verification grows with b·(k + 1) past a fixed cost
    return 0.01 + 0.0012 * b * (k + 1) + 0.0015 * k * (1 + 0.05 * b)


def hidden(b, k):  # drafting rows finish on different rounds: admissions one by one
    return 0.0 if k == 0 else 0.004 * b


@pytest.mark.parametrize("batch_size", [1, 16])
def test_the_gate_keeps_the_policy_near_the_better_of_on_and_off_by_wall_time(batch_size):
    """Where a round's critical path hides what drafting costs, the per-row prediction
    speculates at a loss (its wrong twin: the policy without the gate, shown to lose at 16
    rows); with the gate the policy stays within 3 % of the better of always k = 4 and
    always k = 0, exploration and re-measurements included."""
    rounds = 4000
    on = simulate(None, batch_size, 0.75, cost, rounds, hidden=hidden)
    off = batch_size / cost(batch_size, 0)
    config = {"max_k": 6, "default_k": 4}
    policies = {
        "gated": SpeculationLength(LengthPolicyConfig(**config)),
        "ungated": SpeculationLength(LengthPolicyConfig(**config, gate=None)),
    }
    got = {
        n: simulate(p, batch_size, 0.75, cost, rounds, hidden=hidden) for n, p in policies.items()
    }
    gated, ungated = got["gated"], got["ungated"]
    assert gated >= 0.97 * max(on, off), (gated, on, off)
    if batch_size == 16:
        assert off > on and ungated < 0.97 * off, (ungated, on, off)
    else:
        assert on > off  # where drafting pays the gate stays out of the way


def test_a_closed_gate_leaves_requested_and_forced_lengths_alone():
    policy = SpeculationLength(LengthPolicyConfig(max_k=4, gate=GateConfig(min_rounds=1)))
    bucket = batch_bucket(8)
    policy.gate.observe(bucket, True, 10, 1.0)  # drafting: 10 tokens/s
    policy.gate.observe(bucket, False, 10, 0.1)  # not: 100 tokens/s
    assert policy.plan_round(8) in (None, 0, 1, 4)
    while policy.plan_round(8) is not None:  # past the anchors' first measurements
        pass
    assert policy.choose("d", 8) == 0
    assert policy.choose("d", 8, requested=3) == 3
    assert policy.choose("d", 8, forced=4) == 4


def test_a_new_draft_has_drafting_measured_afresh():
    """A gate closed by the old draft's poor goodput opens to measure the new draft's;
    without new_draft() (the twin) it stays closed but for its rare trials."""
    gate, twin = SpeculationGate(), SpeculationGate()
    for g in (gate, twin):
        gate_rounds(g, 1, 300, rate_on=100.0, rate_off=160.0)
        assert not g.is_open(1)
    gate.new_draft()
    after = gate_rounds(gate, 1, 300, rate_on=300.0, rate_off=160.0)
    assert all(after[:4]) and sum(after[50:]) / len(after[50:]) > 0.9
    stale = gate_rounds(twin, 1, 10, rate_on=300.0, rate_off=160.0)
    assert not any(stale)


@pytest.mark.parametrize("gain, drafts", [(1.05, False), (1.15, True)])
def test_drafting_must_measure_min_gain_faster_to_be_kept(gain, drafts):
    """What drafting costs the rest of the host is not in the rounds: a 5 % gain in them
    is not worth it, a 15 % one is. The wrong twin, no margin, drafts at 5 %."""
    gate = SpeculationGate(GateConfig(min_gain=0.1))
    choices = gate_rounds(gate, 5, 600, rate_on=gain * 800.0, rate_off=800.0)
    share = sum(choices[50:]) / len(choices[50:])
    assert share > 0.9 if drafts else share < 0.1
    assert gate.favours_off(5) is not drafts
    twin = SpeculationGate(GateConfig(min_gain=0.0))
    assert sum(gate_rounds(twin, 5, 600, rate_on=gain * 800.0, rate_off=800.0)[50:]) > 0.9 * 550
    with pytest.raises(ValueError, match="min_gain"):
        GateConfig(min_gain=-0.1)


def test_a_saturated_engine_is_measured_apart_and_needs_a_larger_gain():
    """With requests waiting for a slot, drafting must measure min_gain_queued faster:
    the same bucket drafts at 15 % without a queue and not with one; each state keeps
    its own figures."""
    gate = SpeculationGate(GateConfig(min_gain=0.1, min_gain_queued=0.25))
    free, queued = [], []
    for _ in range(600):
        for q, log in ((False, free), (True, queued)):
            on = gate.is_open(5, queued=q)
            log.append(on)
            gate.observe(5, on, 16, 16 / (920.0 if on else 800.0), queued=q)
    assert sum(free[50:]) / 550 > 0.9 and sum(queued[50:]) / 550 < 0.1
    assert gate.favours_off(5, queued=True) and not gate.favours_off(5)
    assert set(gate.rates()) == {(5, False), (5, True)}


@pytest.mark.parametrize("queued", [False, True])
def test_one_sequence_needs_no_margin_queued_or_not(queued):
    """Below min_gain_from no margin applies, a queue or not: drafting that pays 1.2x at
    one sequence stays open; the twin with the margins from 1 sequence closes it."""
    rates = {"rate_on": 1.2 * 100.0, "rate_off": 100.0}
    for min_gain_from, drafts in ((2, True), (1, False)):
        gate = SpeculationGate(GateConfig(min_gain_from=min_gain_from, min_gain_queued=0.25))
        choices = []
        for _ in range(600):
            on = gate.is_open(1, queued=queued)
            choices.append(on)
            gate.observe(1, on, 2, 2 / (rates["rate_on"] if on else rates["rate_off"]), queued)
        share = sum(choices[50:]) / 550
        if drafts:
            assert share > 0.9
        elif queued:
            assert share < 0.1  # 1.2x < 1.25x


def test_a_saturated_state_runs_without_drafts_first_and_tries_drafting_later():
    """With requests waiting (from min_gain_from sequences), not drafting is the first
    choice, by decision (not a measurement), and drafting is first tried compare_every
    rounds in; where it then measures min_gain_queued faster, the gate opens. The same
    bucket without a queue, and one sequence with one, draft first."""
    config = GateConfig(compare_every=100, min_gain_queued=0.25)
    gate = SpeculationGate(config)
    assert gate.favours_off(5, queued=True)
    assert not gate.favours_off(5) and not gate.favours_off(1, queued=True)
    first = []
    for _ in range(config.compare_every - 1):
        first.append(gate.is_open(5, queued=True))
        assert not gate.trialling
        gate.observe(5, first[-1], 16, 16 / 800.0, queued=True)
    assert not any(first)
    trial = []
    for _ in range(config.compare_rounds):
        trial.append(gate.is_open(5, queued=True))
        assert gate.trialling
        gate.observe(5, trial[-1], 16, 16 / (1.5 * 800.0), queued=True)
    assert all(trial)
    after = []
    for _ in range(300):
        after.append(gate.is_open(5, queued=True))
        gate.observe(5, after[-1], 16, 16 / (1.5 * 800.0 if after[-1] else 800.0), queued=True)
    assert sum(after) / 300 > 0.9 and not gate.favours_off(5, queued=True)
    assert gate.is_open(5) and gate.is_open(1, queued=True)  # the twins: drafting first


def test_new_draft_weights_are_tried_at_once_in_a_saturated_state():
    """A saturated state that measured drafting losing tries new draft weights in the
    next round (a trial), not after its doubled interval between comparisons."""
    gate = SpeculationGate(GateConfig(compare_every=100))
    for _ in range(1000):
        on = gate.is_open(5, queued=True)
        gate.observe(5, on, 16, 16 / (700.0 if on else 800.0), queued=True)
    assert not gate.is_open(5, queued=True)
    gate.new_draft()
    assert gate.is_open(5, queued=True) and gate.trialling


def test_the_length_policy_waits_to_measure_costs_where_the_gate_favours_off():
    """A fresh saturated bucket runs no cost measurement (its rounds at k = 12 would cost
    the most exactly where drafting is presumed to lose); the same bucket without a
    queue measures k = 0 first."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=12))
    assert policy.plan_round(16, {"default"}, queued=True) is None
    assert policy.gate_closed
    assert policy.plan_round(16, {"default"}, queued=False) == 0


def test_a_closed_gate_holds_the_domain_probes_back():
    """A domain the prediction disabled is probed for probe_rounds every probe_every
    rounds, but not where the gate is closed: a probe that began at one sequence does not
    go on in a saturated batch the gate keeps at k = 0 (the wrong twin, probes first,
    drafts its rows)."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=6, probe_every=20, probe_rounds=4))
    ks = []
    for _ in range(400):  # acceptance 0: the prediction says k = 0 at one sequence
        forced = policy.plan_round(1, {"d"})
        ks.append(policy.choose("d", 1, forced=forced))
        policy.observe_round("d", ks[-1], 0)
        policy.observe_round_time(1, ks[-1], 0.01 * (1 + ks[-1]), [("d", ks[-1], 0)])
        if len(ks) > 100 and ks[-2:] == [0, policy.probe_k]:
            break  # a probe just began
    assert ks[-2:] == [0, policy.probe_k] and policy.alpha("d") < 0.05
    policy.plan_round(16, {"d"}, queued=True)  # closed: not drafting runs first here
    assert policy.gate_closed
    assert policy.choose("d", 16) == 0


def test_an_unobserved_measurement_leaves_the_gate_at_its_decision():
    """A measurement of not drafting whose rounds nobody observed (other rows set their
    lengths) leaves a saturated state where drafting won open until the next comparison
    (the first choice there is not drafting: falling back to it would close the gate)."""
    config = GateConfig(compare_every=50, max_compare_every=50, min_gain_queued=0.25)
    gate = SpeculationGate(config)
    for _ in range(200):  # drafting measured 1.5x: open
        on = gate.is_open(5, queued=True)
        gate.observe(5, on, 16, 16 / (1200.0 if on else 800.0), queued=True)
    for _ in range(100):  # on to a measurement of not drafting, whose rounds go unobserved
        if not gate.is_open(5, queued=True) and gate.trialling:
            break
    assert gate.trialling
    for _ in range(config.compare_rounds - 1):
        assert not gate.is_open(5, queued=True)
    after = [gate.is_open(5, queued=True) for _ in range(30)]
    assert all(after)


def test_a_saturated_states_first_trial_of_drafting_drafts():
    """The length policy measured only k = 0 in a saturated bucket (its cost measurements
    wait while the gate presumes drafting loses): when the gate tries drafting, rows draft
    default_k, not the k = 0 the lone measured length would predict."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=6))
    for _ in range(50):  # acceptance learnt at one sequence (0.8)
        k = policy.choose("d", 1, forced=policy.plan_round(1, {"d"}))
        policy.observe_round("d", k, int(0.8 * k))
        policy.observe_round_time(1, k, 0.005 * (1 + k), [("d", k, int(0.8 * k))])
    assert policy.alpha("d") is not None
    ks = []
    for _ in range(GateConfig().compare_every):
        assert policy.plan_round(16, {"d"}, queued=True) is None
        ks.append(policy.choose("d", 16))
        policy.observe_round_time(16, ks[-1], 0.012, [("d", ks[-1], 0)])
        policy.observe_round_wall(16, ks[-1] > 0, 16, 0.012, queued=True)
    assert policy.gate.trialling  # the last round: the gate's first trial of drafting
    assert ks[-1] == policy.default_k and not any(ks[:-1])


def test_decision_reads_the_state_without_counting_a_round():
    """What rows admitted between rounds follow: a fresh state's first choice (open; with
    requests waiting, from 2 sequences, closed), a running measurement's choice, the last
    decision; asking counts no planned round."""
    gate = SpeculationGate(GateConfig(min_rounds=2, compare_rounds=3, compare_every=10))
    wide = batch_bucket(16)
    assert gate.decision(wide) == (True, False)
    assert gate.decision(wide, queued=True) == (False, False)
    assert gate.decision(batch_bucket(1), queued=True) == (True, False)  # no margin at 1
    for _ in range(2):
        gate.observe(wide, True, 10, 1.0)
        gate.observe(wide, False, 100, 1.0)
    assert not gate.is_open(wide)  # decided: not drafting
    planned = gate._gates[(wide, False)].planned
    assert gate.decision(wide) == (False, False)
    while not gate.trialling:
        gate.is_open(wide)
    assert gate.decision(wide) == (True, True)  # measuring drafting afresh
    assert gate._gates[(wide, False)].planned > planned
    n = gate._gates[(wide, False)].planned
    gate.decision(wide)
    assert gate._gates[(wide, False)].planned == n
    while gate.trialling:  # the trial ends ...
        gate.is_open(wide)
    for _ in range(20):  # ... and drafting now measures faster: is_open's verdict
        gate.observe(wide, True, 1000, 1.0)
    assert gate.decision(wide) == (True, False) == (gate.is_open(wide), gate.trialling)
