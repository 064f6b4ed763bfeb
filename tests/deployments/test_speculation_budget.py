"""The overlap budget picks the level with the smallest expected round time (pure)."""

from deployments.config import SpeculationConfig
from deployments.engine import SpeculationBudget

WIDE, BONUS, ONE = (2, True), (2, False), (1, False)


def trained(spec_cost: dict, hit: dict, verify=0.020, draft=0.006):
    budget = SpeculationBudget(SpeculationConfig(speculation_fanout=2), explore_every=10**6)
    # First rounds try every level once.
    assert [budget.next_level() for _ in range(4)] == [WIDE, BONUS, ONE, None]
    for level in (WIDE, BONUS, ONE):
        budget.observe_round(verify, spec_cost[level], level)
        budget.observe_proposals(level, int(hit[level] * 100), 100, draft)
    return budget


def test_wide_speculation_when_it_hides_behind_verification():
    budget = trained({WIDE: 0.012, BONUS: 0.008, ONE: 0.005}, {WIDE: 0.8, BONUS: 0.6, ONE: 0.4})
    assert budget.next_level() == WIDE


def test_narrows_when_branches_outlast_verification():
    budget = trained({WIDE: 0.060, BONUS: 0.022, ONE: 0.012}, {WIDE: 0.8, BONUS: 0.6, ONE: 0.4})
    # WIDE: 60 + 1.2 ms; BONUS: 22 + 2.4; ONE: 20 + 3.6 -> ONE
    assert budget.next_level() == ONE


def test_turns_off_when_speculation_never_pays():
    budget = trained({WIDE: 0.090, BONUS: 0.070, ONE: 0.050}, {WIDE: 0.1, BONUS: 0.1, ONE: 0.1})
    assert budget.next_level() is None


def test_stale_levels_are_re_explored():
    budget = SpeculationBudget(SpeculationConfig(speculation_fanout=2), explore_every=5)
    seen = [budget.next_level() for _ in range(12)]
    assert seen.count(None) >= 2 and seen.count(WIDE) >= 2
