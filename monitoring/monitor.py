"""The monitor: one owner of SpecServe's telemetry and of drift detection, cluster-wide.

Every replica sends batched :class:`~monitoring.metrics.RoundBatch` records here (one
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
from collections.abc import Callable
from dataclasses import asdict

from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk.metrics import MeterProvider

from monitoring.drift import DriftConfig, DriftEvent, DriftMonitor
from monitoring.metrics import RequestRecord, RoundBatch, SpecServeMetrics

logger = logging.getLogger("specserve.monitor")

DRIFT_EVENT = "specserve.acceptance_drift"
SCOPE = "specserve.monitor"


class Monitor:
    """Metrics + drift detection over the records of every replica."""

    def __init__(
        self,
        meter_provider: MeterProvider,
        logger_provider: LoggerProvider,
        drift: DriftConfig | None = None,
        on_drift: Callable[[DriftEvent], None] | None = None,
    ):
        self.meter_provider, self.logger_provider = meter_provider, logger_provider
        self.metrics = SpecServeMetrics(meter_provider.get_meter(SCOPE))
        self.otel_logger = logger_provider.get_logger(SCOPE)
        self.detector = DriftMonitor(drift)
        self.on_drift = on_drift  # e.g. the policy's reaction (k for the domain)
        self.events: list[DriftEvent] = []  # every alert change, newest last

    def report(self, batch: RoundBatch) -> list[DriftEvent]:
        """Record one replica flush; returns the drift alerts it started or resolved."""
        self.metrics.record_rounds(batch)
        rounds = [r for r in batch.rounds if r.drafted > 0]
        if not rounds:
            return []
        events = self.detector.observe(
            [r.domain for r in rounds], [r.drafted for r in rounds], [r.accepted for r in rounds]
        )
        for event in events:
            self._alert(batch.model, event)
        return events

    def report_request(self, record: RequestRecord) -> None:
        self.metrics.record_request(record)

    def _alert(self, model: str, event: DriftEvent) -> None:
        firing = event.kind == "fire"
        self.events.append(event)
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
            self.on_drift(event)

    def acknowledge(self, domain: str) -> None:
        """An operator accepts the new level: the domain learns a new baseline."""
        self.detector.acknowledge(domain)

    def new_draft_deployed(self) -> None:
        """A new draft changes every domain's acceptance: learn all baselines again."""
        self.detector.rebaseline_all()

    def shutdown(self) -> None:
        self.meter_provider.shutdown()
        self.logger_provider.shutdown()


def build_providers(prometheus_port: int | None, cardinality_limit: int = 2000):
    """Providers for the monitor deployment: a Prometheus endpoint on ``prometheus_port``
    (its own registry, so nothing else in the process leaks into it) and OTLP push of
    metrics and logs when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set. Past
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
        readers.append(PrometheusMetricReader(registry=registry))
        start_http_server(prometheus_port, addr="0.0.0.0", registry=registry)
    logger_provider = LoggerProvider()
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        logger_provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
    views = [View(instrument_name="*", aggregation_cardinality_limit=cardinality_limit)]
    return MeterProvider(metric_readers=readers, views=views), logger_provider, registry
