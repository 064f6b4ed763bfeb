"""The ``monitor`` Serve deployment: one actor per application that owns telemetry.

Replicas are separate processes, so an exporter port per replica would clash; instead
every replica's engine sends its batched round and request records here (one call per
``flush_interval_s``, from a task of its own, never from the round loop) and this one
actor owns the OpenTelemetry MeterProvider and LoggerProvider, serves the single
Prometheus scrape endpoint, pushes OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, and
runs the drift detectors on the whole application's rounds. The drift alerts go back to
the replicas in the reply to their next flush, for their length policies.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from monitoring.alertmanager import AlertmanagerPush
from monitoring.config import MonitoringConfig
from monitoring.monitor import Monitor, build_providers
from monitoring.records import (
    AdaptationRecord,
    AlertCursor,
    ReportReply,
    RequestRecord,
    RoundBatch,
)

logger = logging.getLogger("specserve.monitor")


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=10,
)
class MonitorDeployment:
    """Records every replica's flushes; see the module docstring."""

    def __init__(self, config: dict[str, Any]):
        self.config = MonitoringConfig.model_validate(config)
        meter_provider, logger_provider, _ = build_providers(
            self.config.prometheus_port,
            self.config.cardinality_limit,
            self.config.prometheus_host,
            self.config.otlp_endpoint,
        )
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-alert-push")
        push = (
            AlertmanagerPush(self.config.alertmanager_url) if self.config.alertmanager_url else None
        )
        self.push = push
        self.monitor = Monitor(
            meter_provider,
            logger_provider,
            self.config.drift,
            on_drift=None if push is None else (lambda e, m: self._pool.submit(push, e, m)),
        )
        self.flushes = 0
        self.draft_version = 0  # the newest adapted draft version a replica reported

    async def report(
        self, batch: RoundBatch, requests: list[RequestRecord], cursor: AlertCursor | None
    ) -> ReportReply:
        """One replica's flush. Returns the drift alerts after ``cursor`` and the cursor to
        send next time."""
        self.flushes += 1
        self.monitor.report(batch)
        for record in requests:
            self.monitor.report_request(record)
        return self.monitor.alerts_since(cursor)

    async def acknowledge(self, domain: str) -> None:
        """An operator accepts the domain's new acceptance level: learn its baseline anew."""
        self.monitor.acknowledge(domain)

    async def new_draft_deployed(self, version: int | None = None) -> bool:
        """A new draft model: every domain learns its baseline anew. ``version``: the
        adapted draft version a replica now serves; every replica reports it, and only
        the first report of a version newer than any seen re-baselines. Returns whether
        this call did."""
        if version is not None:
            if version <= self.draft_version:
                return False
            self.draft_version = version
        self.monitor.new_draft_deployed()
        logger.info("new draft (version %s): every domain's baseline is learnt anew", version)
        return True

    async def acceptance(
        self, domain: str, last_rounds: int | None = None
    ) -> dict[int, tuple[int, int, int]]:
        """``{draft version: (rounds, accepted, rejections)}`` of ``domain``'s newest
        drafted rounds (``last_rounds`` per version at least, where seen): what the
        adaptation deployment judges a swapped draft by."""
        return self.monitor.versions.counts(domain, last_rounds)

    async def serving_speed(self, window_s: float = 5.0) -> float | None:
        """Output tokens per second of request time over the last ``window_s`` (see
        Monitor.serving_speed): what a training run keeps its cost to serving by."""
        return self.monitor.serving_speed(window_s)

    async def adaptation_event(self, record: dict[str, Any]) -> None:
        """An adaptation outcome (AdaptationRecord fields): metrics and a log record."""
        self.monitor.report_adaptation(AdaptationRecord(**record))

    async def status(self) -> dict[str, Any]:
        """Drift state per domain and alert history (for tests, dashboards and operators)."""
        det = self.monitor.detector
        domains = {}
        for name in det.domains:
            s = det.status(name)
            domains[name] = {
                "state": s.state.value,
                "baseline": s.baseline,
                "current": s.current,
                "k": s.k,
                "break_even": s.break_even,
                "warmup_seen": s.warmup_seen,
                "dispersion": s.dispersion,
                # the detector's current run (the reverse one while firing): rounds seen
                # in it and its statistic against its threshold
                "rounds": s.rounds,
                "statistic": s.statistic,
                "threshold": s.threshold,
                "drift_since": self.monitor.drift_since(name),
            }
        return {
            "flushes": self.flushes,
            "domains": domains,
            "events": [
                {"kind": e.kind, "domain": e.domain, "current": e.current, "rounds": e.rounds}
                for e in self.monitor.events
            ],
            "alertmanager_pushes": None if self.push is None else self.push.sent,
            "draft_version": self.draft_version,
        }

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter exit: providers may be gone
            self.monitor.shutdown()
