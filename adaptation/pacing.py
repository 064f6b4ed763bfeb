"""How hard a training run may work while the app serves: a duty cycle closed on serving's
measured speed (pure; the run's task feeds it and sleeps as it says).

A run shares hardware with serving wherever it is not given its own (on this machine, the
two cores; on a GPU node, the draft's GPU when ``trainer.num_gpus`` shares it), and the OS
priority it lowers itself to does not bound what it takes on a GPU, or from a serving
process that sleeps between rounds. So the run paces itself: after each optimizer step of
``s`` seconds it pauses ``s * (1 - duty) / duty``, and the duty follows serving's speed,
measured by the monitor as output tokens per second of request time over the requests that
finished in the last window (so a quiet period is not mistaken for a slowdown; the
engines' round time alone missed most of it: on 2 shared cores a run slows the replica's
HTTP and frontend work as much as the rounds):

* it starts at ``start_duty`` (a half);
* speed below ``(1 - max_slowdown) x`` the speed before the run: the duty halves (down to
  ``min_duty``);
* otherwise it grows by ``step_up`` (up to 1: no pause).

The speed before the run is its baseline. A run that starts on an idle app has none: when
traffic appears it pauses for two measuring windows, and what serving did in the second
is the baseline. Halving on a violation and growing slowly back (AIMD, as TCP shares a link)
settles at the largest duty that keeps serving within its bound.
"""

from __future__ import annotations

import math


class ServingPace:
    """The duty cycle of one training run; see the module docstring."""

    def __init__(
        self,
        max_slowdown: float,
        baseline: float | None,
        window_s: float,
        min_duty: float = 0.05,
        step_up: float = 0.1,
        start_duty: float = 0.5,
    ):
        if not 0.0 <= max_slowdown <= 1.0 or not 0.0 < min_duty <= start_duty <= 1.0:
            raise ValueError("need 0 <= max_slowdown <= 1 and 0 < min_duty <= start_duty <= 1")
        if window_s <= 0:
            raise ValueError("need window_s > 0")
        self.max_slowdown, self.min_duty, self.step_up = max_slowdown, min_duty, step_up
        self.baseline = (
            baseline if baseline and baseline > 0 else None
        )  # [tokens/s of request time]
        self.window_s = window_s
        # the fraction of wall time the run computes: half at first (a run's first
        # window would otherwise cost serving everything its cores can take), growing
        # while serving keeps its speed
        self.duty = start_duty
        # pausing to measure the baseline: the windows still to skip before the one taken
        # (the first may hold the end of the step that was running when traffic came)
        self.calibrating: int | None = None
        self.pauses_s = 0.0  # slept so far [s]
        self.violations = 0  # checks that found serving slower than its bound

    @property
    def off(self) -> bool:
        return self.max_slowdown >= 1.0

    def observe(self, speed: float | None) -> None:
        """Serving's speed over the last window [output tokens per second of request time]; None
        while it served nothing (no evidence either way: the duty stays)."""
        if self.off:
            return
        if speed is None or speed <= 0:
            # Nothing served: no evidence of a slowdown. A calibration stops (the run
            # trains on; it measures again when traffic comes back).
            self.calibrating = None
            return
        if self.calibrating is not None:
            if self.calibrating == 0:  # this window ran without training: the baseline
                self.baseline, self.calibrating = speed, None
            else:
                self.calibrating -= 1
            return
        if self.baseline is None:
            self.calibrating = 1  # traffic came: measure it alone first
            return
        if speed < (1.0 - self.max_slowdown) * self.baseline:
            self.violations += 1
            self.duty = max(self.min_duty, self.duty / 2)
        else:
            self.duty = min(1.0, self.duty + self.step_up)

    def pause_after(self, step_s: float) -> float:
        """Seconds to pause after an optimizer step that took ``step_s``."""
        if self.off:
            return 0.0
        if self.calibrating is not None:
            pause = 2 * self.window_s  # the window skipped and the one measured
        else:
            pause = step_s * (1.0 - self.duty) / self.duty
        pause = pause if math.isfinite(pause) and pause > 0 else 0.0
        self.pauses_s += pause
        return pause

    def report(self) -> dict[str, float | int | None]:
        return {
            "duty": round(self.duty, 3),
            "baseline_tokens_per_s": None if self.baseline is None else round(self.baseline, 2),
            "paused_s": round(self.pauses_s, 2),
            "violations": self.violations,
        }
