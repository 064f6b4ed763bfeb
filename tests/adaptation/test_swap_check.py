"""The live check of a deployed draft version (pure)."""

from adaptation.swap_check import Counts, check_swap

KW = {"window_rounds": 64, "max_drop": 0.05, "min_before_rounds": 16}


def test_waits_for_its_window_then_keeps_a_version_that_holds_up():
    before = Counts(rounds=100, accepted=60, rejections=40)  # alpha 0.6
    d = check_swap(before, Counts(63, 200, 20), None, **KW)
    assert d.decision == "wait" and d.rounds == 63
    d = check_swap(before, Counts(64, 56, 44), None, **KW)  # 0.56: within 0.05
    assert d.decision == "keep" and d.before_source == "live"
    assert d.before == 0.6 and d.after == 0.56


def test_rolls_back_a_version_more_than_max_drop_below_the_one_before():
    before = Counts(rounds=100, accepted=60, rejections=40)
    d = check_swap(before, Counts(64, 54, 46), None, **KW)  # 0.54 < 0.6 - 0.05
    assert d.decision == "roll_back" and "0.540" in d.reason


def test_with_few_live_rounds_before_the_held_back_agreement_is_the_reference():
    few = Counts(rounds=3, accepted=0, rejections=3)  # the policy had stopped drafting
    d = check_swap(few, Counts(64, 50, 50), 0.2, **KW)
    assert d.decision == "keep" and d.before_source == "held_back" and d.before == 0.2
    d = check_swap(few, Counts(64, 10, 90), 0.2, **KW)  # 0.1 < 0.2 - 0.05
    assert d.decision == "roll_back"
    d = check_swap(few, Counts(64, 10, 90), None, **KW)
    assert d.decision == "keep" and d.before_source == "none"


def test_a_watch_that_times_out_judges_what_it_saw():
    before = Counts(rounds=100, accepted=60, rejections=40)
    assert check_swap(before, Counts(), None, timed_out=True, **KW).decision == "keep"
    d = check_swap(before, Counts(10, 1, 9), None, timed_out=True, **KW)
    assert d.decision == "roll_back"
