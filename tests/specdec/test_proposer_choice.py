"""The per-domain proposer choice (pure): measured goodput decides, losers are re-measured."""

import pytest

from specdec.proposer_choice import ProposerChoice, ProposerChoiceConfig

CFG = ProposerChoiceConfig(explore_rounds=4, probe_every=50, probe_rounds=4, min_gain=0.05)


def run(policy, domain, batch, rounds, goodput):
    """``rounds`` row-rounds: each choice observed at ``goodput[method]`` tokens per second
    (one second rounds); returns the choices made."""
    chosen = []
    for _ in range(rounds):
        m = policy.choose(domain, batch)
        chosen.append(m)
        policy.observe(domain, batch, m, goodput[m], 1.0)
    return chosen


def test_each_domain_gets_the_proposer_that_measured_best():
    policy = ProposerChoice(CFG)
    code = run(policy, "code", 1, 200, {"draft_model": 2.0, "ngram": 3.5})
    prose = run(policy, "prose", 1, 200, {"draft_model": 2.5, "ngram": 1.0})
    assert code[:8] == ["draft_model"] * 4 + ["ngram"] * 4  # both measured first
    assert code[8:].count("ngram") > 0.9 * len(code[8:])
    assert prose[8:].count("draft_model") > 0.9 * len(prose[8:])
    state = policy.state()
    assert state["code"]["1"]["method"] == "ngram"
    assert state["prose"]["1"]["goodput"]["draft_model"] == pytest.approx(2.5)


def test_the_loser_is_remeasured_at_a_bounded_rate_and_a_change_is_followed():
    policy = ProposerChoice(CFG)
    before = run(policy, "d", 4, 300, {"draft_model": 2.0, "ngram": 3.0})
    probes = before[8:].count("draft_model")
    assert 0 < probes <= (300 // CFG.probe_every + 1) * CFG.probe_rounds
    after = run(policy, "d", 4, 300, {"draft_model": 2.0, "ngram": 0.5})  # text changed
    assert after[-100:].count("draft_model") > 90


def test_a_challenger_must_gain_min_gain_to_take_over():
    policy = ProposerChoice(CFG)
    chosen = run(policy, "d", 1, 400, {"draft_model": 2.0, "ngram": 2.06})  # +3 %
    assert chosen[8:].count("draft_model") > 0.9 * len(chosen[8:])


def test_batch_sizes_are_measured_apart():
    policy = ProposerChoice(CFG)
    run(policy, "d", 1, 100, {"draft_model": 3.0, "ngram": 1.0})
    run(policy, "d", 16, 100, {"draft_model": 1.0, "ngram": 2.0})
    assert policy.choose("d", 1) == "draft_model" and policy.choose("d", 16) == "ngram"


def test_without_the_draft_model_ngram_drafts_and_a_new_draft_is_measured_again():
    policy = ProposerChoice(CFG)
    run(policy, "d", 1, 100, {"draft_model": 1.0, "ngram": 2.0})
    assert policy.choose("d", 1, available=["ngram"]) == "ngram"
    policy.new_draft()
    assert run(policy, "d", 1, 4, {"draft_model": 3.0, "ngram": 2.0}) == ["draft_model"] * 4
    assert policy.choose("d", 1) == "draft_model"


def test_only_the_configured_proposers_are_chosen_and_bad_settings_are_refused():
    policy = ProposerChoice(CFG, methods=["ngram"])
    assert set(run(policy, "d", 1, 50, {"draft_model": 9.0, "ngram": 1.0})) == {"ngram"}
    with pytest.raises(ValueError, match="subset"):
        ProposerChoice(CFG, methods=["eagle"])
    with pytest.raises(ValueError, match=">= 1"):
        ProposerChoiceConfig(explore_rounds=0)
