"""The Serve deployment that hosts one :class:`SpecEngine` per replica.

Each replica is created inside its own placement group (Serve's
``placement_group_bundles``): bundle 0 holds the replica, the target and draft workers go
into their bundles, so scaling the deployment scales whole draft/target pairs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import ray
from ray import serve

from deployments.config import EngineConfig
from deployments.engine import SpecEngine
from deployments.placement import placement_for
from specdec.sampling import SamplingParams

logger = logging.getLogger("specserve.engine")


def load_tokenizer(config: EngineConfig):
    """The target's tokenizer, or None when the model directory has none (tiny test models)."""
    from transformers import AutoTokenizer

    source = config.target.tokenizer or config.target.model
    try:
        return AutoTokenizer.from_pretrained(
            source, trust_remote_code=config.target.trust_remote_code
        )
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer at %s (%s); token ids only", source, exc)
        return None


@serve.deployment(max_ongoing_requests=512, health_check_period_s=5)
class EngineDeployment:
    """Runs the engine; the HTTP ingress (or any handle) calls :meth:`generate`."""

    async def __init__(self, config: dict[str, Any]):
        self.config = EngineConfig.model_validate(config)
        self.tokenizer = load_tokenizer(self.config)
        pg = ray.util.get_current_placement_group()
        self.engine = SpecEngine(self.config, placement_group=pg, tokenizer=self.tokenizer)
        await self.engine.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the outputs of one request.

        ``request``: ``prompt_token_ids``, ``params`` (SamplingParams fields), and optional
        ``num_speculative_tokens``, ``speculation`` (bool) and ``request_id``.
        """
        params = SamplingParams(**request.get("params", {}))
        async for out in self.engine.generate(
            list(request["prompt_token_ids"]),
            params,
            num_speculative_tokens=request.get("num_speculative_tokens"),
            speculation=request.get("speculation", True),
            request_id=request.get("request_id"),
        ):
            yield {
                **asdict(out),
                "stats": {
                    **asdict(out.stats),
                    "acceptance_rate": out.stats.acceptance_rate,
                    "mean_acceptance_length": out.stats.mean_acceptance_length,
                },
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

    async def timings(self) -> dict[str, Any]:
        t = self.engine.timings
        return {**asdict(t), "overhead_s": t.overhead_s}

    async def check_health(self) -> None:
        """Serve's health check: a replica whose target cannot be restarted is unhealthy."""
        if self.engine._fatal:
            raise RuntimeError(self.engine._fatal)


def build_engine(
    config: EngineConfig,
    *,
    num_replicas: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    name: str = "SpecServeEngine",
):
    """A bound engine deployment with its placement group per replica."""
    placement = placement_for(config)
    options: dict[str, Any] = {
        "name": name,
        "placement_group_bundles": placement.bundles,
        "placement_group_strategy": placement.strategy,
        "ray_actor_options": {
            # The replica must fit in bundle 0 of its placement group.
            "num_cpus": placement.bundles[0].get("CPU", 0),
            "num_gpus": placement.bundles[0].get("GPU", 0),
        },
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    elif num_replicas is not None:
        options["num_replicas"] = num_replicas
    return EngineDeployment.options(**options).bind(config.model_dump())
