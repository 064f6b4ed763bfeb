"""The ``adaptation`` Serve deployment: one actor per application that keeps the data.

Why one deployment and not a buffer per replica: an operator must be able to list and
drop a domain's data in one call (a Serve handle reaches one replica of a deployment,
never all of them), and the draft's trainer will read every replica's traffic from one
place. Replicas send each finished request here without waiting for the reply (it is not
on any request's path); the call is a few kilobytes of token ids.

Operators reach it through Ray (never through the clients' HTTP port)::

    h = serve.get_deployment_handle("SpecServeAdaptation", "SpecServe")
    h.summary.remote().result()       # {domain: {requests, tokens, oldest_age_s}}
    h.drop.remote("python").result()  # forget one domain's requests now
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from ray import serve

from adaptation.config import AdaptationConfig
from adaptation.retention import RetainedRequest, RetentionBuffer

logger = logging.getLogger("specserve.adaptation")


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=10,
)
class AdaptationDeployment:
    """Holds the application's :class:`RetentionBuffer`; see the module docstring."""

    def __init__(self, config: dict[str, Any]):
        self.config = AdaptationConfig.model_validate(config)
        self.buffer = RetentionBuffer(self.config.retention)

    async def retain(
        self, domain: str, prompt_token_ids: list[int], output_token_ids: list[int], at: float
    ) -> bool:
        """A replica's finished request; returns whether it was kept."""
        record = RetainedRequest(domain, tuple(prompt_token_ids), tuple(output_token_ids), at)
        return self.buffer.add(record)

    async def summary(self) -> dict[str, dict[str, float]]:
        """Per domain: requests and tokens kept, and the oldest's age in seconds."""
        return {domain: asdict(s) for domain, s in self.buffer.summary().items()}

    async def records(self, domain: str) -> list[dict[str, Any]]:
        """The domain's kept requests, oldest first (token ids: an operator's view)."""
        return [asdict(r) for r in self.buffer.records(domain)]

    async def drop(self, domain: str) -> int:
        """Forget every kept request of ``domain``, in memory and on disk; how many."""
        gone = self.buffer.drop(domain)
        logger.info("retention: dropped %d requests of domain %r", gone, domain)
        return gone
