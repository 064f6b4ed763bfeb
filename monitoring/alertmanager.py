"""Optional direct push of drift alerts to Alertmanager's v2 API.

Prometheus already turns the ``specserve_acceptance_drift`` gauge into the
``SpecServeAcceptanceDrift`` alert (``prometheus/alerts.yml``); the push is for setups
without Prometheus rules, and it reaches Alertmanager a scrape and an evaluation sooner.
It uses the same alert name and labels, so Alertmanager deduplicates the two.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from datetime import UTC, datetime

from monitoring.drift import DriftEvent

logger = logging.getLogger("specserve.alertmanager")

ALERT_NAME = "SpecServeAcceptanceDrift"


def drift_alert(event: DriftEvent, model: str, now: datetime | None = None) -> dict:
    """The v2 ``postableAlert`` for a fire (open: no end) or a resolve (ends now)."""
    now = now or datetime.now(UTC)
    alert = {
        "labels": {
            "alertname": ALERT_NAME,
            "severity": "warning",
            "model": model,
            "domain": event.domain,
            "service": "specserve",
        },
        "annotations": {
            "summary": f"Draft acceptance drifted on domain {event.domain} of {model}",
            "description": (
                f"alpha_hat {event.current:.3f} over {event.rounds} rounds vs baseline "
                f"{event.baseline:.3f} (break-even {event.break_even:.3f} at k={event.k})"
            ),
        },
    }
    if event.kind == "resolve":
        alert["endsAt"] = now.isoformat()
    return alert


class AlertmanagerPush:
    """POSTs drift alerts to ``{url}/api/v2/alerts``; failures are logged, never raised
    (an unreachable Alertmanager must not stop monitoring)."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.timeout_s = timeout_s
        self.sent = self.failed = 0

    def __call__(self, event: DriftEvent, model: str) -> bool:
        body = json.dumps([drift_alert(event, model)]).encode()
        req = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                ok = 200 <= resp.status < 300
        except OSError as exc:
            logger.warning("could not push the drift alert to %s: %r", self.url, exc)
            ok = False
        self.sent += ok
        self.failed += not ok
        return ok
