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


class TrainerConfig(BaseModel):
    """One adaptation run: distil the draft on a domain's retained requests, validate the
    candidate on held-back requests, deploy it only if it is better."""

    model_config = ConfigDict(extra="forbid")

    on_drift: bool = Field(
        default=True,
        description="Start a run for a domain when the monitor's drift alert fires for it "
        "(runs can always be started on demand through the deployment's handle).",
    )
    min_requests: int = Field(
        default=16,
        ge=2,
        description="Retained requests a run needs: for a run on drift, requests of the "
        "domain that finished since its shift (some are held back); a retry needs as many "
        "new ones again.",
    )
    lookback_s: float = Field(
        default=30.0,
        ge=0.0,
        description="Where the monitor gives no change point for a drift (the detector's "
        "estimate of when it began), the domain's requests that finished this long before "
        "its alert fired count as drifted; older ones are the traffic from before the "
        "shift, replayed and scored apart.",
    )
    retry_after_s: float = Field(
        default=120.0,
        gt=0.0,
        description="While a domain's alert keeps firing, seconds from one of its runs to "
        "the next (after a rejected run, or a deployed one that did not bring acceptance "
        "back).",
    )
    held_back_fraction: float = Field(
        default=0.2,
        gt=0.0,
        lt=1.0,
        description="Of each domain's retained requests, the share kept out of training "
        "to score the candidate on.",
    )
    steps: int = Field(default=150, ge=1, description="Optimizer steps at most.")
    max_seconds: float = Field(
        default=300.0, gt=0.0, description="Wall seconds of training at most (then it stops)."
    )
    batch_size: int = Field(default=16, ge=1, description="Requests per optimizer step.")
    lr: float = Field(default=1e-3, gt=0.0, description="Peak learning rate (AdamW).")
    replay_fraction: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description="Share of each batch drawn from the other domains' retained requests, "
        "so that the draft does not forget them.",
    )
    min_gain: float = Field(
        default=0.05,
        description="Agreement with the target the candidate must gain on the domain's "
        "held-back requests to be deployed.",
    )
    max_loss: float = Field(
        default=0.05,
        ge=0.0,
        description="Agreement the candidate may lose on any other domain's held-back "
        "requests and still be deployed.",
    )
    num_cpus: float = Field(
        default=1.0,
        ge=0.0,
        description="CPUs the training task reserves (a Ray task of its own, so that "
        "training never runs in a serving process).",
    )
    num_gpus: float = Field(default=0.0, ge=0.0, description="GPUs the training task reserves.")
    num_threads: int = Field(
        default=1, ge=1, description="torch threads the training task uses (bounds its CPU)."
    )
    adapter_min_params: int = Field(
        default=100_000_000,
        ge=1,
        description="A draft with at least this many parameters trains low-rank adapters "
        "(LoRA, the optional peft library) instead of every weight, and a swap ships "
        "their factors (megabytes) to replicas serving the version they were trained on.",
    )
    lora_rank: int = Field(default=16, ge=1, le=256, description="Rank of each adapter.")
    lora_alpha: float = Field(
        default=32.0, gt=0.0, description="LoRA's alpha: the update is scaled by alpha / rank."
    )
    max_serving_slowdown: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="The most a run may slow serving: the run pauses between optimizer "
        "steps so that serving's speed (output tokens per second of request time, from the "
        "monitor) stays at least (1 - this) x its speed before the run "
        "(adaptation/pacing.py: the share of time the run trains starts at a half, halves "
        "while serving is slower, grows by a tenth per window while it is not). 1: never "
        "pause.",
    )
    pacing_window_s: float = Field(
        default=5.0,
        gt=0.0,
        le=300.0,
        description="Seconds of serving each check of max_serving_slowdown measures (a "
        "check every window).",
    )
    niceness: int = Field(
        default=19,
        ge=0,
        le=19,
        description="OS priority the training task's process lowers itself by (nice; 19: "
        "the lowest): on cores it shares with serving it takes the CPU time serving leaves "
        "idle, so serving slows little while a run trains (bench.adaptation measures "
        "tokens/s during runs against before); 0 trains at serving's priority.",
    )


class RollbackConfig(BaseModel):
    """When a deployed version is taken back by itself: its live acceptance on the domain
    it was trained for, over its first rounds there, against the version before it."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True,
        description="Watch each version a run deployed and roll it back by itself when "
        "its live acceptance falls short (an operator can always roll back by hand).",
    )
    window_rounds: int = Field(
        default=64,
        ge=1,
        le=4096,  # the monitor keeps about this many rounds per (domain, version)
        description="Drafted rounds of the domain, on every replica together, the new "
        "version is judged on.",
    )
    max_drop: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Roll back when the new version's live acceptance (alpha_hat) on the "
        "domain is more than this below the version before it.",
    )
    min_before_rounds: int = Field(
        default=16,
        ge=1,
        description="Drafted rounds the version before needs on the domain for its live "
        "acceptance to be the reference (a domain the policy had stopped drafting has "
        "few); with fewer, the run's held-back agreement before training stands in.",
    )
    max_wait_s: float = Field(
        default=3600.0,
        gt=0.0,
        description="Seconds the watch waits for its window of rounds; after that the "
        "version is kept with what was seen (said so in its record).",
    )


class AdaptationConfig(BaseModel):
    """Draft adaptation to live traffic: which data it may learn from, how it trains,
    and how replicas learn of a new draft version."""

    model_config = ConfigDict(extra="forbid")

    retention: RetentionConfig = Field(
        default_factory=RetentionConfig,
        description="Which finished requests are kept, per domain, and for how long.",
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="How a run trains, validates and decides. Runs learn from retained "
        "requests: with retention off there is no adaptation deployment and no run.",
    )
    rollback: RollbackConfig = Field(
        default_factory=RollbackConfig,
        description="Automatic rollback of a deployed version whose live acceptance on "
        "its domain falls short of the version before.",
    )
    enabled: bool = Field(
        default=True,
        description="Runs may start and deploy. The adaptation deployment's set_enabled "
        "turns this off and on at run time (retention goes on either way; the version "
        "served stays, though the live check of a version already deployed may still roll "
        "it back).",
    )
    poll_interval_s: float = Field(
        default=5.0,
        gt=0.0,
        le=300.0,
        description="How often each replica asks the adaptation deployment for the draft "
        "version to serve (a new or restarted replica asks at once).",
    )
