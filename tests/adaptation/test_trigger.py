"""When a drifted domain gets a run, and the data it trains on (pure)."""

from adaptation.retention import RetainedRequest
from adaptation.trigger import PendingDomain, run_data, should_run

KW = {"min_requests": 3, "lookback_s": 10.0, "retry_after_s": 60.0, "watching": False}


def recs(domain, times):
    return [RetainedRequest(domain, (1, 2), (3,), t) for t in times]


def test_a_run_waits_for_drifted_requests_not_the_old_traffic():
    pending = PendingDomain("python", fired_at=100.0)
    old = recs("python", range(0, 80))  # 80 requests from before the shift
    assert not should_run(pending, old + recs("python", [95, 101]), 102.0, **KW)
    assert should_run(pending, old + recs("python", [95, 101, 103]), 104.0, **KW)
    assert not should_run(
        pending, old + recs("python", [95, 101, 103]), 104.0, **{**KW, "watching": True}
    )


def test_a_retry_waits_its_time_and_new_requests():
    pending = PendingDomain("python", fired_at=100.0, last_run_at=110.0, last_run_newest=109.0)
    drifted = recs("python", [101, 105, 109])
    assert not should_run(
        pending, drifted + recs("python", [120, 130, 140]), 150.0, **KW
    )  # too soon
    assert not should_run(pending, drifted + recs("python", [120, 130]), 175.0, **KW)  # 2 new
    assert should_run(pending, drifted + recs("python", [120, 130, 140]), 175.0, **KW)


def test_run_data_keeps_the_periods_apart():
    data = run_data(
        {"python": recs("python", [1, 2, 50, 60]), "prose": recs("prose", [5])}, "python", 40.0
    )
    assert [r.finished_at for r in data["python"]] == [50, 60]
    assert [r.finished_at for r in data["python (before the drift)"]] == [1, 2]
    assert len(data["prose"]) == 1
    assert "python (before the drift)" not in run_data(
        {"python": recs("python", [50])}, "python", 40.0
    )
