"""StopLengths: where rows' drafts end, estimated from rounds at any k (pure)."""

import random

import pytest

from specdec.stop_lengths import StopLengths


def truth(stops: list[int], k: int) -> float:
    """The mean drafts a row gets at k when its drafts end at each of ``stops``."""
    return sum(min(s, k) for s in stops) / len(stops)


def test_nothing_seen_means_no_stop():
    assert StopLengths().expected_drafts_upto(4) == [1.0, 2.0, 3.0, 4.0]
    assert StopLengths().expected_drafts(0) == 0.0


def test_rows_that_ran_to_the_end_give_the_mean_at_every_shorter_k():
    """Rows asked for the longest k: the drafts at every k are the mean of min(L, k)."""
    stops = [0, 1, 1, 2, 3, 5, 8, 8, 8]
    lengths = StopLengths(decay=1.0)
    lengths.observe([(s, 8) for s in stops])
    for k in range(1, 9):
        assert lengths.expected_drafts(k) == pytest.approx(truth(stops, k))


def test_rows_that_got_all_they_asked_for_are_not_taken_for_stopped():
    """Half the rows asked for 2 and got both (they would have gone on: censored), half
    asked for 12: every k is estimated as the same draft would give it. Counting the
    rows that got their 2 as ended there would put k = 12 at about 2."""
    rng = random.Random(0)
    stops = [1, 2, 3, 4, 6, 9, 12]
    lengths = StopLengths(decay=1.0)
    for _ in range(4000):
        asked = rng.choice([2, 12])
        lengths.observe([(min(rng.choice(stops), asked), asked)])
    for k in (2, 6, 12):
        assert lengths.expected_drafts(k) == pytest.approx(truth(stops, k), rel=0.05)


def test_the_counts_fade_so_a_changed_draft_or_text_shows():
    lengths = StopLengths(decay=0.98)
    for _ in range(300):
        lengths.observe([(1, 8)])  # stops at once
    for _ in range(300):
        lengths.observe([(8, 8)])  # then never
    assert lengths.expected_drafts(8) > 7.9
