"""The monitor deployment's settings: metrics, domains, drift detection and alerts.

They live here, not in ``deployments/``, because the monitor is a deployment of its own
that imports nothing of the serving side; ``deployments.config.AppConfig`` embeds them as
its ``monitoring`` field (see docs/architecture.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from monitoring.drift import DriftConfig

__all__ = ["DriftConfig", "MonitoringConfig"]


class MonitoringConfig(BaseModel):
    """The monitor deployment: metrics, drift detection and alerts for the whole app."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True,
        description="Run the monitor deployment and send it every replica's round records.",
    )
    prometheus_port: int | None = Field(
        default=9464,
        ge=1,
        le=65535,
        description="Port of the monitor's Prometheus scrape endpoint (one per app: only the "
        "monitor serves it, so replicas never clash); None: no endpoint (OTLP only).",
    )
    prometheus_host: str = Field(
        default="127.0.0.1",
        description="Address the scrape endpoint listens on: loopback by default (it has "
        "no authentication); a node's private address when Prometheus runs elsewhere.",
    )
    flush_interval_s: float = Field(
        default=1.0,
        gt=0.0,
        le=60.0,
        description="How often each replica sends its round records to the monitor.",
    )
    domain_source: Literal["none", "user", "metadata", "header"] = Field(
        default="metadata",
        description="Where a request's traffic domain comes from: the OpenAI 'user' field, "
        "the 'metadata' key named by domain_key, or the HTTP header named by domain_key; "
        "'none' puts every request in default_domain.",
    )
    domain_key: str = Field(
        default="domain",
        min_length=1,
        max_length=64,
        description="The metadata key or header name that carries the domain.",
    )
    default_domain: str = Field(
        default="default",
        min_length=1,
        max_length=64,
        description="The global key: the domain of requests that name none.",
    )
    domains: list[str] | None = Field(
        default=None,
        description="Known domains (the allow-list); others go to overflow_domain. None: "
        "any name is accepted until max_domains are in use (first come, never expiring), "
        "later ones go to overflow_domain. Set it when clients are not trusted: they "
        "choose their domain names (see monitoring/README.md, Domains).",
    )
    max_domains: int = Field(
        default=64,
        ge=1,
        le=10_000,
        description="Most distinct domains tracked per replica (and label values per metric).",
    )
    overflow_domain: str = Field(
        default="__overflow__", description="Where unknown domains and those past the cap go."
    )
    cardinality_limit: int = Field(
        default=2000,
        ge=10,
        description="Label sets per instrument before the SDK folds new ones into its "
        "overflow series (otel.metric.overflow=true).",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="Optional OTLP/HTTP base URL (e.g. http://collector:4318) for metrics and "
        "the drift log records; without it OTEL_EXPORTER_OTLP_ENDPOINT in the monitor's "
        "environment is used when set.",
    )
    alertmanager_url: str | None = Field(
        default=None,
        description="Optional: also push drift alerts straight to this Alertmanager "
        "(v2 API, e.g. http://127.0.0.1:9093) on firing and on resolve.",
    )
    drift: DriftConfig = Field(
        default_factory=DriftConfig, description="The per-domain CUSUM drift detector."
    )
