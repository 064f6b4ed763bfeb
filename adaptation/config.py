"""The adaptation deployment's settings. Embedded in ``deployments.config.AppConfig`` as
its ``adaptation`` field; they live here because the adaptation deployment, like the
monitor, imports nothing of the serving side."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RetentionConfig(BaseModel):
    """Which finished requests are kept as training data for the draft, and for how long.

    A retained request is its prompt's and its output's token ids: the prompt is user
    text. Nothing is kept unless ``enabled``; SECURITY.md says what, where and how long."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False,
        description="Keep finished requests' token ids (prompt and committed output) per "
        "traffic domain. Off: nothing is kept and no adaptation deployment runs.",
    )
    domains: list[str] | None = Field(
        default=None,
        description="The traffic domains whose requests may be kept (an allow list); None: "
        "every domain. A request of any other domain is never kept.",
    )
    max_tokens_per_domain: int = Field(
        default=1_000_000,
        ge=1,
        description="Most tokens (prompt + output) kept per domain: the oldest requests go "
        "first once a new one would pass it.",
    )
    max_age_s: float = Field(
        default=86_400.0,
        gt=0.0,
        description="Seconds a request is kept after it finished; older ones are dropped.",
    )
    max_request_tokens: int = Field(
        default=16_384,
        ge=1,
        description="A request with more tokens than this is not kept (it would crowd out "
        "the rest of its domain).",
    )
    directory: str | None = Field(
        default=None,
        description="Where retained requests are also written (one JSON-lines file per "
        "domain, readable by the deployment's user only), so they outlive a restart; None: "
        "memory only, lost when the adaptation deployment stops.",
    )


class AdaptationConfig(BaseModel):
    """Draft adaptation to live traffic: for now, which data it may learn from."""

    model_config = ConfigDict(extra="forbid")

    retention: RetentionConfig = Field(
        default_factory=RetentionConfig,
        description="Which finished requests are kept, per domain, and for how long.",
    )
