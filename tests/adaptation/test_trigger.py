"""When a drifted domain gets a run, and the data it trains on (pure)."""

from adaptation.retention import RetainedRequest
from adaptation.trigger import run_data, should_run, start_pending

KW = {"min_requests": 3, "retry_after_s": 60.0, "watching": False}


def recs(domain, times):
    return [RetainedRequest(domain, (1, 2), (3,), t) for t in times]


def test_a_run_waits_for_drifted_requests_not_the_old_traffic():
    pending = start_pending("python", 100.0, lookback_s=10.0)
    assert pending.since == 90.0
    old = recs("python", range(0, 80))  # 80 requests from before the shift
    assert not should_run(pending, old + recs("python", [95, 101]), 102.0, **KW)
    assert should_run(pending, old + recs("python", [95, 101, 103]), 104.0, **KW)
    watching = {**KW, "watching": True}
    assert not should_run(pending, old + recs("python", [95, 101, 103]), 104.0, **watching)


def test_a_retry_waits_its_time_and_new_requests():
    pending = start_pending("python", 100.0, lookback_s=10.0)
    pending.last_run_at, pending.last_run_newest = 110.0, 109.0
    drifted = recs("python", [101, 105, 109])
    assert not should_run(pending, drifted + recs("python", [120, 130, 140]), 150.0, **KW)
    assert not should_run(pending, drifted + recs("python", [120, 130]), 175.0, **KW)  # 2 new
    assert should_run(pending, drifted + recs("python", [120, 130, 140]), 175.0, **KW)


def test_an_alert_that_fires_again_on_the_adapted_draft_continues_its_drift():
    """The requests between the first alert and the second are drifted, not the traffic
    to keep: the run after the second alert is judged against the traffic before the first.
    A new drift (the draft served was not adapted for it) starts afresh."""
    first = start_pending("python", 100.0, lookback_s=10.0)
    again = start_pending("python", 500.0, 10.0, previous=first, continues=True)
    assert again.since == 90.0 and again.fired_at == 500.0
    fresh = start_pending("python", 500.0, 10.0, previous=first, continues=False)
    assert fresh.since == 490.0


def test_run_data_keeps_the_periods_apart():
    data = run_data(
        {"python": recs("python", [1, 2, 50, 60]), "prose": recs("prose", [5])}, "python", 40.0
    )
    assert [r.finished_at for r in data["python"]] == [50, 60]
    assert [r.finished_at for r in data["python (before the drift)"]] == [1, 2]
    assert len(data["prose"]) == 1
    only_new = run_data({"python": recs("python", [50])}, "python", 40.0)
    assert "python (before the drift)" not in only_new


def test_the_detectors_change_point_marks_the_drifted_requests():
    pending = start_pending("python", 100.0, lookback_s=30.0, change_point=93.5)
    assert pending.since == 93.5  # not 70.0: the lookback is the fallback
