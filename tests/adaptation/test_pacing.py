"""The training run's duty cycle (pure): halves when serving is slower than its bound,
grows back while it is not, measures a baseline when traffic comes to an idle app."""

import pytest

from adaptation.pacing import ServingPace


def test_the_duty_halves_below_the_bound_and_grows_back_above_it():
    pace = ServingPace(max_slowdown=0.2, baseline=100.0, window_s=2.0, start_duty=1.0)
    assert pace.pause_after(1.0) == 0.0  # full duty: no pause
    pace.observe(79.0)  # below 0.8 x 100
    assert pace.duty == 0.5 and pace.pause_after(1.0) == pytest.approx(1.0)
    pace.observe(70.0)
    assert pace.duty == 0.25 and pace.pause_after(1.0) == pytest.approx(3.0)
    pace.observe(85.0)  # within the bound: a step back up
    assert pace.duty == pytest.approx(0.35)
    for _ in range(20):
        pace.observe(95.0)
    assert pace.duty == 1.0 and pace.violations == 2


def test_the_duty_never_falls_below_its_floor_and_quiet_windows_change_nothing():
    pace = ServingPace(max_slowdown=0.1, baseline=50.0, window_s=2.0, min_duty=0.05)
    for _ in range(10):
        pace.observe(1.0)
    assert pace.duty == 0.05 and pace.pause_after(0.1) == pytest.approx(0.1 * 19)
    pace.observe(None)  # nothing served: no evidence
    assert pace.duty == 0.05


def test_an_idle_start_measures_its_baseline_in_a_pause_once_traffic_comes():
    pace = ServingPace(max_slowdown=0.2, baseline=None, window_s=3.0, start_duty=1.0)
    pace.observe(None)
    assert pace.pause_after(1.0) == 0.0  # no traffic: train freely
    pace.observe(40.0)  # traffic, measured while training: not a baseline
    assert pace.baseline is None and pace.pause_after(1.0) == 6.0
    pace.observe(42.0)  # the first window of the pause may hold the step's end: skipped
    pace.observe(60.0)  # the second: serving alone
    assert pace.baseline == 60.0 and pace.pause_after(1.0) == 0.0
    pace.observe(45.0)
    assert pace.duty == 0.5


def test_a_run_starts_at_half_duty_and_grows_while_serving_keeps_its_speed():
    pace = ServingPace(max_slowdown=0.2, baseline=100.0, window_s=2.0)
    assert pace.duty == 0.5 and pace.pause_after(1.0) == pytest.approx(1.0)
    for _ in range(5):
        pace.observe(90.0)
    assert pace.duty == pytest.approx(1.0)


def test_a_bound_of_one_never_pauses_and_bad_settings_are_refused():
    pace = ServingPace(max_slowdown=1.0, baseline=10.0, window_s=1.0)
    pace.observe(0.5)
    assert pace.pause_after(1.0) == 0.0 and pace.violations == 0
    with pytest.raises(ValueError):
        ServingPace(max_slowdown=1.5, baseline=None, window_s=1.0)
    with pytest.raises(ValueError):
        ServingPace(max_slowdown=0.2, baseline=None, window_s=0.0)


def test_a_calibration_stops_when_the_traffic_goes_away():
    """A short burst on an idle app must not hold the run in calibration pauses."""
    pace = ServingPace(max_slowdown=0.2, baseline=None, window_s=5.0)
    pace.observe(30.0)  # traffic: calibrate
    assert pace.pause_after(0.1) == 10.0
    pace.observe(None)  # gone again
    assert pace.calibrating is None and pace.pause_after(0.1) == pytest.approx(0.1)
