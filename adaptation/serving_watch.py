"""A training run's side of pacing: the thread that asks the monitor how fast serving is
and the pause after each optimizer step (the decisions are :class:`ServingPace`'s)."""

from __future__ import annotations

import logging
import threading
import time

from adaptation.pacing import ServingPace

logger = logging.getLogger("specserve.adaptation")

CALL_TIMEOUT_S = 30.0


class ServingWatch:
    """Feeds ``pace`` with the monitor's serving speed every ``pace.window_s`` on a thread
    of the run's own task, from the run's first optimizer step on (loading and scoring
    before it are not what the duty governs), and pauses the run after each step as it
    says."""

    def __init__(self, monitor, pace: ServingPace):
        self.monitor, self.pace = monitor, pace
        self._lock = threading.Lock()  # the pace is read by the run, fed by the thread
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="serving-watch", daemon=True)

    def _loop(self) -> None:
        while not self._stopped.wait(self.pace.window_s):
            try:
                speed = self.monitor.serving_speed.remote(self.pace.window_s).result(
                    timeout_s=CALL_TIMEOUT_S
                )
            except Exception as exc:  # no evidence this window: the duty stays
                logger.warning("pacing: could not read serving's speed: %r", exc)
                continue
            with self._lock:
                self.pace.observe(speed)

    def after_step(self, step_s: float) -> None:
        """The pause after an optimizer step of ``step_s`` seconds (often none)."""
        if not self._thread.is_alive() and not self._stopped.is_set():
            self._thread.start()  # the first step: watching starts now
        with self._lock:
            pause = self.pace.pause_after(step_s)
        if pause > 0:
            time.sleep(pause)

    def stop(self) -> dict:
        """End the thread; what pacing did (for the run's summary)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=CALL_TIMEOUT_S + 1)
        with self._lock:
            return self.pace.report()
