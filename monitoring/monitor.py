"""The monitor: one owner of SpecServe's telemetry and of drift detection, cluster-wide.

Every replica sends batched :class:`~monitoring.records.RoundBatch` records here (one
message per flush, off the round's critical path). The monitor records them as
OpenTelemetry metrics, runs the per-domain drift detectors
(:class:`~monitoring.drift.DriftMonitor`) on the whole cluster's rounds, and on every
alert change emits an OpenTelemetry log record (event ``specserve.acceptance_drift``,
WARN when it fires, INFO when it resolves) and sets the ``specserve.acceptance_drift``
gauge. Providers are passed in (no global provider is touched): the Serve deployment
builds them with :func:`build_providers` (a Prometheus scrape endpoint, and OTLP push
when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set); tests pass in-memory readers.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk.metrics import MeterProvider

from monitoring.drift import DriftConfig, DriftEvent, DriftMonitor, DriftState
from monitoring.metrics import SpecServeMetrics
from monitoring.records import (
    AdaptationRecord,
    AlertCursor,
    AlertRecord,
    ReportReply,
    RequestRecord,
    RoundBatch,
)
from monitoring.version_acceptance import VersionAcceptance
from specdec.speedup import break_even_alpha

logger = logging.getLogger("specserve.monitor")

DRIFT_EVENT = "specserve.acceptance_drift"
ADAPTATION_EVENT = "specserve.adaptation"
SCOPE = "specserve.monitor"


class Monitor:
    """Metrics + drift detection over the records of every replica."""

    def __init__(
        self,
        meter_provider: MeterProvider,
        logger_provider: LoggerProvider,
        drift: DriftConfig | None = None,
        on_drift: Callable[[DriftEvent, str], object] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.meter_provider, self.logger_provider = meter_provider, logger_provider
        self.metrics = SpecServeMetrics(meter_provider.get_meter(SCOPE))
        self.otel_logger = logger_provider.get_logger(SCOPE)
        self.detector = DriftMonitor(drift)
        cfg = self.detector.config
        # α̂ per (domain, draft version): what a swapped draft is judged by
        self.versions = VersionAcceptance(
            max_domains=cfg.max_domains, overflow_domain=cfg.overflow_domain
        )
        self.on_drift = on_drift  # e.g. a direct push to Alertmanager
        self.events: list[DriftEvent] = []  # alert changes, newest last (the last MAX_EVENTS)
        self._events_before = 0  # alert changes dropped from the front of ``events``
        self._firing: dict[str, float] = {}  # domain -> current alpha at its firing alert
        self._ratios: dict[str, dict[str, dict[int, float]]] = {}  # domain -> replica -> T(k)/T(0)
        # Cursors carry it: a restarted monitor numbers its alerts from 0 again, and a
        # replica's cursor from before must not skip (or replay) them.
        self.epoch = uuid.uuid4().hex[:12]
        self.clock = clock
        # (unix s, output tokens, duration s) per finished request, the last
        # SPEED_HISTORY_S: what serving_speed divides
        self._speed: deque[tuple[float, int, float]] = deque()
        # domain -> the last report after which its forward CUSUM stood at 0 [unix s]: when
        # it fires, the change point estimate (where the evidence against the baseline began)
        self._calm_at: dict[str, float] = {}
        self._drift_since: dict[str, float] = {}  # firing domain -> its change point [unix s]

    MAX_EVENTS = 1000

    SPEED_HISTORY_S = 600.0  # the longest window serving_speed answers for

    def report(self, batch: RoundBatch) -> list[DriftEvent]:
        """Record one replica flush; returns the drift alerts it started or resolved."""
        self.metrics.record_rounds(batch)
        for domain, choice in batch.policy.items():
            ratios = choice.get("round_time_ratio") or {}
            if ratios:
                self._set_ratios(batch.replica, domain, ratios)
            if choice.get("proposers"):
                self.metrics.set_proposers(batch.model, batch.replica, domain, choice["proposers"])
            k = choice.get("k")
            if k is not None:
                be = self._break_even(k, ratios.get(k))
                self.metrics.set_policy(batch.model, batch.replica, domain, k, be)
        # The detector and the per-version counts watch the draft model: n-gram lookup
        # has no weights to drift or adapt (its rounds are in the metrics, by proposer).
        rounds = [r for r in batch.rounds if r.drafted > 0 and r.proposer == "draft_model"]
        if not rounds:
            return []
        self.versions.observe(
            [r.domain for r in rounds],
            [r.draft_version for r in rounds],
            [r.drafted for r in rounds],
            [r.accepted for r in rounds],
        )
        events = self.detector.observe(
            [r.domain for r in rounds], [r.drafted for r in rounds], [r.accepted for r in rounds]
        )
        self._note_calm({r.domain for r in rounds})
        for event in events:
            self._alert(batch.model, event)
        return events

    def _note_calm(self, domains: set[str]) -> None:
        now = self.clock()
        for domain in domains & set(self.detector.domains):
            status = self.detector.status(domain)
            if status.state is not DriftState.FIRING and status.statistic == 0.0:
                self._calm_at[domain] = now

    def drift_since(self, domain: str) -> float | None:
        """When the firing ``domain``'s drift began, as Page's CUSUM estimates it: the
        last report after which its statistic stood at 0 (unix seconds; None when it
        does not fire). Adaptation takes the domain's requests from then on as drifted."""
        return self._drift_since.get(domain)

    def report_request(self, record: RequestRecord) -> None:
        self.metrics.record_request(record)
        self._note_speed(record)

    def alerts_since(self, cursor: AlertCursor | None) -> ReportReply:
        """Alert changes after ``cursor`` for the replicas' length policies, and the
        cursor to send next time. A replica new to this monitor (no cursor, or one from a
        monitor that has since restarted) gets only the alerts firing now, not history it
        would misread as news. One that fell more than MAX_EVENTS behind gets the latest."""
        if isinstance(cursor, tuple):  # from a replica of before records.py: (epoch, count)
            cursor = AlertCursor(*cursor)
        end = AlertCursor(self.epoch, self._events_before + len(self.events))
        if cursor is None or cursor.epoch != self.epoch:
            return ReportReply([AlertRecord(d, a) for d, a in self._firing.items()], end)
        start = max(0, cursor.count - self._events_before)
        return ReportReply([AlertRecord(e.domain, e.current) for e in self.events[start:]], end)

    def _set_ratios(self, replica: str, domain: str, ratios: dict[int, float]) -> None:
        """The detector's break-even for a domain from every replica's latest measured
        ``T(k) / T(0)``, averaged per k (replicas at different batch sizes disagree; the
        latest report alone would flip the alternative hypothesis from flush to flush)."""
        by_replica = self._ratios.setdefault(domain, {})
        by_replica[replica] = ratios
        ks = {k for r in by_replica.values() for k in r}
        mean = {
            k: sum(r[k] for r in by_replica.values() if k in r)
            / sum(1 for r in by_replica.values() if k in r)
            for k in ks
        }
        self.detector.set_round_time_ratios(domain, mean)

    def _break_even(self, k: int, round_time_ratio: float | None = None) -> float:
        """Break-even acceptance at ``k`` (0 at k = 0): from the replica's measured
        ``T(k) / T(0)`` when it has one, else from the configured cost ratios."""
        if k < 1:
            return 0.0
        if round_time_ratio is not None and round_time_ratio > 0:
            return break_even_alpha(k, 0.0, round_time_ratio)
        cfg = self.detector.config
        return break_even_alpha(k, cfg.cost_ratio, cfg.verify_ratio)

    def _alert(self, model: str, event: DriftEvent) -> None:
        firing = event.kind == "fire"
        self.events.append(event)
        if firing:
            self._firing[event.domain] = event.current
            self._drift_since[event.domain] = self._calm_at.get(event.domain, self.clock())
        else:
            self._firing.pop(event.domain, None)
            self._drift_since.pop(event.domain, None)
        if len(self.events) > self.MAX_EVENTS:
            del self.events[0]
            self._events_before += 1
        self.metrics.set_drift(model, event.domain, firing, event.baseline)
        attrs = {k: v for k, v in asdict(event).items() if v is not None}
        attrs = {f"specserve.{k}": v for k, v in attrs.items()}
        attrs["model"] = model
        self.otel_logger.emit(
            event_name=DRIFT_EVENT,
            severity_number=SeverityNumber.WARN if firing else SeverityNumber.INFO,
            severity_text="WARN" if firing else "INFO",
            body=(
                f"acceptance drift {'firing' if firing else 'resolved'} for domain "
                f"{event.domain!r}: alpha {event.current:.3f} vs baseline {event.baseline:.3f}"
            ),
            attributes=attrs,
        )
        (logger.warning if firing else logger.info)("%s %s", DRIFT_EVENT, attrs)
        if self.on_drift is not None:
            self.on_drift(event, model)

    def report_adaptation(self, record: AdaptationRecord) -> None:
        """An adaptation outcome: its metrics, and a log record (WARN for a rollback or a
        failure, INFO otherwise)."""
        self.metrics.record_adaptation(record)
        attrs = {f"specserve.{k}": v for k, v in asdict(record).items() if v is not None}
        attrs["model"] = record.model
        bad = record.outcome in ("rolled_back", "failed")
        self.otel_logger.emit(
            event_name=ADAPTATION_EVENT,
            severity_number=SeverityNumber.WARN if bad else SeverityNumber.INFO,
            severity_text="WARN" if bad else "INFO",
            body=f"draft adaptation {record.outcome} for domain {record.domain!r} "
            f"(version {record.version}): {record.reason}",
            attributes=attrs,
        )
        (logger.warning if bad else logger.info)("%s %s", ADAPTATION_EVENT, attrs)

    def acknowledge(self, domain: str) -> None:
        """An operator accepts the new level: the domain learns a new baseline."""
        self.detector.acknowledge(domain)
        self._firing.pop(domain, None)
        self._drift_since.pop(domain, None)  # (no resolve follows: new replicas must not hear it)

    def new_draft_deployed(self) -> None:
        """A new draft changes every domain's acceptance: baselines are learnt again,
        a firing domain's once its alert resolved (:meth:`DriftMonitor.new_draft`)."""
        self.detector.new_draft()

    def shutdown(self) -> None:
        self.meter_provider.shutdown()
        self.logger_provider.shutdown()

    def _note_speed(self, record: RequestRecord) -> None:
        if record.error_type is not None or record.output_tokens <= 0 or record.duration_s <= 0:
            return
        now = self.clock()
        self._speed.append((now, record.output_tokens, record.duration_s))
        while self._speed and self._speed[0][0] < now - self.SPEED_HISTORY_S:
            self._speed.popleft()

    def serving_speed(self, window_s: float) -> float | None:
        """Output tokens per second of request time, over the requests that finished in
        the last ``window_s`` on every replica (their tokens summed over their durations):
        how fast a request is served, whatever the replica does between requests, so an
        idle stretch is not a slowdown (a training run paces itself by it,
        adaptation/pacing.py). It falls as well when more requests share the engine: the
        pacing compares it over seconds, in which the offered load seldom changes much.
        None without a finished request in the window."""
        since = self.clock() - window_s
        tokens = seconds = 0.0
        for at, n, duration in reversed(self._speed):
            if at < since:
                break
            tokens, seconds = tokens + n, seconds + duration
        return tokens / seconds if seconds > 0 else None


def build_providers(
    prometheus_port: int | None,
    cardinality_limit: int = 2000,
    host: str = "127.0.0.1",
    otlp_endpoint: str | None = None,
):
    """Providers for the monitor deployment: a Prometheus endpoint on ``prometheus_port``
    (its own registry, so nothing else in the process leaks into it) and OTLP push of
    metrics and logs to ``otlp_endpoint`` (a base URL; ``/v1/metrics`` and ``/v1/logs`` are
    appended) or, without it, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set. Past
    ``cardinality_limit`` label sets per instrument the SDK folds new ones into one
    overflow series (``otel.metric.overflow=true``), so unbounded domains cannot explode
    the series count. Returns ``(meter_provider, logger_provider, registry)``."""
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.metrics.view import View
    from prometheus_client import CollectorRegistry, start_http_server

    readers, registry = [], None
    if prometheus_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        registry = CollectorRegistry()
        try:
            start_http_server(prometheus_port, addr=host, registry=registry)
        except OSError as exc:  # port taken: monitoring must not take serving down
            logger.error(
                "cannot serve Prometheus metrics on %s:%s (%s); continuing without the "
                "endpoint (set monitoring.prometheus_port to a free port)",
                host,
                prometheus_port,
                exc,
            )
            registry = None
        else:
            readers.append(PrometheusMetricReader(registry=registry))
    logger_provider = LoggerProvider()
    if otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        base = otlp_endpoint.rstrip("/") if otlp_endpoint else None
        metrics = OTLPMetricExporter(endpoint=base and f"{base}/v1/metrics")
        logs = OTLPLogExporter(endpoint=base and f"{base}/v1/logs")
        readers.append(PeriodicExportingMetricReader(metrics))
        logger_provider.add_log_record_processor(BatchLogRecordProcessor(logs))
    views = [View(instrument_name="*", aggregation_cardinality_limit=cardinality_limit)]
    return MeterProvider(metric_readers=readers, views=views), logger_provider, registry
