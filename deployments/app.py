"""The Serve application: replicas that run the engine and its HTTP API, and a monitor.

Each ``SpecServeDeployment`` replica owns a draft/target pair; the one ``monitor``
deployment (:mod:`monitoring.deployment`) receives every replica's round records and
serves metrics and drift alerts for all of them; with ``adaptation.retention.enabled``,
the one adaptation deployment (:mod:`adaptation.deployment`) keeps finished requests.

``serve deploy cluster/serve/demo.yaml`` imports :func:`build_app` with the YAML's
``args``; those are validated by :class:`deployments.config.AppConfig`, the same schema
Python callers use through :func:`build_specserve_app`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from adaptation.deployment import AdaptationDeployment
from deployments.config import AppConfig, EngineConfig
from deployments.frontend.engine_client import EngineClient
from deployments.frontend.request_state import RequestState
from deployments.messages import TokenLogprob
from deployments.openai.api_keys import KeyStore
from deployments.openai.server import create_app
from deployments.placement import placement_for, replica_actor_options
from monitoring.deployment import MonitorDeployment
from monitoring.domains import DomainResolver
from specdec.attention import UnsupportedModelError, attention_layout
from specdec.sampling import SamplingParams
from specdec.vocab import check_tokenizers

logger = logging.getLogger("specserve.app")

# Calls to the adaptation deployment a replica keeps in flight at most (each holds a
# request's token ids; past it a finished request is not kept), and how long each may take.
MAX_ADAPTATION_CALLS = 1000
ADAPTATION_CALL_TIMEOUT_S = 30.0


def load_tokenizer(config: EngineConfig, role: str = "target"):
    """The target's (or draft's) tokenizer, or None when the model directory has none
    (tiny test models)."""
    from transformers import AutoTokenizer

    spec = getattr(config, role)
    source = spec.tokenizer or spec.model
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer at %s (%s); token ids only", source, exc)
        return None


def preflight(config: EngineConfig, tokenizer) -> None:
    """Refuse a pair SpecServe cannot serve exactly before any weight is loaded: configs
    whose attention layers the runner cannot mask, and a draft whose tokenizer maps text
    to other ids than the target's. Raises :class:`UnsupportedModelError` with the reason
    (the replica fails to start, and Serve reports the deployment as failed)."""
    from transformers import AutoConfig

    for role in ("target", "draft"):
        spec = getattr(config, role)
        if spec is None:
            continue
        try:
            attention_layout(
                AutoConfig.from_pretrained(spec.model, trust_remote_code=spec.trust_remote_code)
            )
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{role} {spec.model}: {exc}") from None
    if config.draft is None or tokenizer is None:
        return
    draft_tokenizer = load_tokenizer(config, "draft")
    if draft_tokenizer is None:
        raise UnsupportedModelError(
            f"the draft {config.draft.model} has no tokenizer to compare with the target's: "
            "set draft.tokenizer to the tokenizer it was trained with"
        )
    check_tokenizers(tokenizer, draft_tokenizer)


@serve.deployment(max_ongoing_requests=512, health_check_period_s=5)
@serve.ingress()
class SpecServeDeployment:
    """A replica: the engine (with its own draft/target workers) plus the OpenAI API."""

    async def __init__(
        self,
        config: dict[str, Any],
        monitor: DeploymentHandle | None = None,
        adaptation: DeploymentHandle | None = None,
    ):
        self.config = AppConfig.model_validate(config)
        # Keys are read here, in the replica: its environment and its node's files.
        self.keys = KeyStore.from_config(self.config, os.environ)
        if self.keys.enabled:
            logger.info("API keys: %s", self.keys)  # names and limits; keys never
        else:
            logger.warning("no API key configured: /v1/* is open to anyone who reaches it")
        self.tokenizer = load_tokenizer(self.config.engine)
        preflight(self.config.engine, self.tokenizer)
        pg = ray.util.get_current_placement_group()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.monitor = monitor
        self.adaptation = adaptation
        self._retaining: set[asyncio.Task] = set()  # calls in flight (held against GC)
        self.domains = DomainResolver(self.config.monitoring)  # for handle calls
        self.engine = EngineClient(
            self.config.engine,
            placement_group=pg,
            tokenizer=self.tokenizer,
            telemetry=self._send_telemetry if monitor is not None else None,
            flush_interval_s=self.config.monitoring.flush_interval_s,
            replica=self.replica_id,
            on_finished=self._retain if adaptation is not None else None,
        )
        await self.engine.start()
        if adaptation is not None and self.config.engine.draft is not None:
            self._follow = asyncio.get_running_loop().create_task(self._follow_versions())

    async def _follow_versions(self) -> None:
        """Serve the draft version the adaptation deployment says, checked at once and
        then every ``adaptation.poll_interval_s`` (a failed check retries next time)."""
        while True:
            try:
                serving = self.engine.health()["draft_version"]
                version = await self.adaptation.served_version.remote(serving)
                if version != serving:
                    refs = await self.adaptation.weights.remote(version, serving)
                    if refs:  # else the version moved on meanwhile: the next check
                        weights = await refs[0]  # (factors over what it serves, or all)
                        full = refs[1] if len(refs) > 1 else None
                        await self.engine.load_draft_weights(version, weights, full)
                        logger.info("draft version %d served", version)
                        if self.monitor is not None:  # acceptance changes: new baselines
                            call = self.monitor.new_draft_deployed.remote(version)
                            self._background(call, f"draft version {version} to the monitor")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("could not follow the draft version: %r", exc)
            await asyncio.sleep(self.config.adaptation.poll_interval_s)

    def _retain(self, req: RequestState) -> None:
        """Send a finished request to the adaptation deployment, off the request's path
        (a lost send loses one training example, never a request)."""
        if len(self._retaining) >= MAX_ADAPTATION_CALLS:  # the deployment is not keeping up
            logger.warning(
                "retention: request %s not kept (too many sends pending)", req.request_id
            )
            return
        call = self.adaptation.retain.remote(
            req.domain, req.prompt_token_ids, list(req.output_token_ids)
        )
        self._background(call, f"retain {req.request_id}")

    async def _send_telemetry(self, batch, requests, cursor):
        """The engine's telemetry sink: one call to the monitor deployment per flush. New
        drift alerts also go to the adaptation deployment (a run for their domain)."""
        reply = await self.monitor.report.remote(batch, requests, cursor)
        if self.adaptation is not None:
            for domain in {alert.domain for alert in reply.alerts}:
                self._background(self.adaptation.on_drift.remote(domain), f"drift on {domain}")
        return reply

    def _background(self, call, what: str) -> None:
        """Await a handle call off the caller's path; a failure is logged, never raised."""

        async def wait() -> None:
            try:
                async with asyncio.timeout(ADAPTATION_CALL_TIMEOUT_S):
                    await call
            except Exception as exc:
                logger.warning("adaptation deployment call (%s) failed: %r", what, exc)

        task = asyncio.get_running_loop().create_task(wait())
        self._retaining.add(task)
        task.add_done_callback(self._retaining.discard)

    def __serve_build_asgi_app__(self):
        return create_app(self.config, self.engine, self.tokenizer, self.replica_id, keys=self.keys)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Token-level streaming for Python handles (benchmarks, tests).

        ``request``: ``prompt_token_ids``, ``params`` (SamplingParams fields), and optional
        ``num_speculative_tokens``, ``speculation`` (bool), ``method`` (the proposer),
        ``request_id`` and ``domain``.
        """
        params = SamplingParams(**request.get("params", {}))
        async for out in self.engine.generate(
            list(request["prompt_token_ids"]),
            params,
            num_speculative_tokens=request.get("num_speculative_tokens"),
            speculation=request.get("speculation", True),
            method=request.get("method"),
            request_id=request.get("request_id"),
            domain=self.domains.bound(request.get("domain")),
        ):
            s = out.stats
            yield {
                **asdict(out),
                # The handle's shapes as they were: stats' four counts and two rates, each
                # logprob as (logprob, [(token id, logprob), ...]).
                "stats": {
                    "drafted": s.drafted,
                    "accepted": s.accepted,
                    "rounds": s.rounds,
                    "cache_hits": s.cache_hits,
                    "acceptance_rate": s.acceptance_rate,
                    "mean_acceptance_length": s.mean_acceptance_length,
                },
                "logprobs": _pairs(out.logprobs),
                "prompt_logprobs": _pairs(out.prompt_logprobs),
                "replica_id": self.replica_id,
            }

    async def health_info(self) -> dict[str, Any]:
        return {
            **self.engine.health(),
            "replica_id": self.replica_id,
            "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
            "target": self.engine.target_info,
            "draft": self.engine.draft_info,
        }

    async def timings(self, reset: bool = False) -> dict[str, Any]:
        """The engine core's per-round split (verify, draft waits, overhead)."""
        return await self.engine.round_timings(reset)

    async def check_health(self) -> None:
        """Serve's health check, from the same status as GET /health: unhealthy exactly
        when /health answers 503 (target failed for good, or being replaced). Serve
        replaces a replica after 3 failed checks in a row, so a target replacement that
        takes less than that keeps the replica and its requests."""
        h = self.engine.health()
        if h["status"] == "unavailable":
            raise RuntimeError(h["error"] or "the target worker is being replaced")


def build_specserve_app(*, config: AppConfig, name: str = "SpecServe") -> Application:
    """The bound application; each replica gets its own placement group for its pair."""
    placement = placement_for(config.engine)
    options: dict[str, Any] = {
        "name": name,
        "placement_group_bundles": placement.bundles,
        "placement_group_strategy": placement.strategy,
        # The replica runs in bundle 0 and claims the engine's resources only: the rest of
        # that bundle is the target's when STRICT_SPREAD puts them together.
        "ray_actor_options": replica_actor_options(config.engine),
    }
    if config.autoscaling_config is not None:
        options["autoscaling_config"] = config.autoscaling_config
    else:
        options["num_replicas"] = config.num_replicas
    monitor = None
    if config.monitoring.enabled:
        monitor = MonitorDeployment.options(name=f"{name}Monitor").bind(
            config.monitoring.model_dump()
        )
    adaptation = None
    if config.adaptation.retention.enabled:
        draft = config.engine.draft
        source = None
        if draft is not None:
            source = {
                "model": draft.model,
                "dtype": draft.dtype,
                "trust_remote_code": draft.trust_remote_code,
            }
        adaptation = AdaptationDeployment.options(name=f"{name}Adaptation").bind(
            config.adaptation.model_dump(), source, monitor, config.engine.model_name
        )
    return SpecServeDeployment.options(**options).bind(config.model_dump(), monitor, adaptation)


def build_app(args: dict[str, Any]) -> Application:
    """Entry point for ``serve deploy``: ``import_path: deployments.app:build_app``."""
    return build_specserve_app(config=AppConfig.model_validate(args))


def _pairs(scored: list[TokenLogprob] | None) -> list[tuple] | None:
    """Log-probabilities as the handle API gives them: ``(logprob, [(id, logprob), ...])``."""
    if scored is None:
        return None
    return [(t.logprob, None if t.top is None else list(t.top.items())) for t in scored]
