"""Acceptance per (domain, draft version): the figures a swapped draft is judged by."""

import pytest

from monitoring.version_acceptance import VersionAcceptance


def test_versions_are_counted_apart_and_rounds_without_drafts_say_nothing():
    led = VersionAcceptance()
    # interleaved: two replicas swap at different times
    led.observe(
        ["py", "py", "py", "py", "prose"], [0, 1, 0, 1, 1], [4, 4, 0, 4, 2], [1, 4, 0, 3, 2]
    )
    assert led.counts("py") == {0: (1, 1, 1), 1: (2, 7, 1)}  # (rounds, accepted, rejections)
    assert led.counts("prose") == {1: (1, 2, 0)}
    assert led.counts("never") == {}


def test_only_the_newest_rounds_are_kept_and_asked_for():
    led = VersionAcceptance(window_rounds=10)
    for accepted in (4, 4, 0, 0):  # four batches of five rounds each
        led.observe(["d"] * 5, [0] * 5, [4] * 5, [accepted] * 5)
    assert led.counts("d") == {0: (10, 0, 10)}  # the two oldest batches left
    assert led.counts("d", last_rounds=5) == {0: (5, 0, 5)}
    assert led.counts("d", last_rounds=6) == {0: (10, 0, 10)}  # whole batches


def test_versions_and_domains_are_bounded():
    led = VersionAcceptance(max_versions=2, max_domains=2, overflow_domain="other")
    for v in range(4):
        led.observe(["d"], [v], [4], [4])
    assert sorted(led.counts("d")) == [2, 3]
    led.observe(["e", "f", "g"], [0, 0, 0], [4, 4, 4], [0, 1, 2])
    assert led.counts("f") == {} and led.counts("other") == {0: (2, 3, 2)}
    with pytest.raises(ValueError):
        led.observe(["d"], [0, 1], [4], [4])
