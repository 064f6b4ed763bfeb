"""The ``adaptation`` Serve deployment: one actor per application that keeps the data,
runs adaptation, and holds the draft version every replica must serve.

Why one deployment and not a buffer per replica: an operator must be able to list and
drop a domain's data in one call (a Serve handle reaches one replica of a deployment,
never all of them), training must see every replica's traffic, and every replica must
serve the same approved draft. Replicas send each finished request here without waiting
for the reply, and ask every ``poll_interval_s`` which version to serve (a new or
restarted replica asks at once), fetching the weights when it changed.

A run (:func:`adaptation.candidate.run`) trains in a Ray task with the trainer's own
resources, never in a serving process; one runs at a time. It starts when a replica
reports the monitor's drift alert for a domain (``trainer.on_drift``), or on demand.

Operators reach it through Ray (never through the clients' HTTP port)::

    h = serve.get_deployment_handle("SpecServeAdaptation", "SpecServe")
    h.summary.remote().result()       # {domain: {requests, tokens, oldest_age_s}}
    h.drop.remote("python").result()  # forget one domain's requests now
    h.adapt.remote("prose").result()  # a run now; returns its verdict and scores
    h.status.remote().result()        # the version served, runs and their outcomes
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any

import ray
from ray import serve

from adaptation.candidate import DraftSource, run
from adaptation.config import AdaptationConfig
from adaptation.retention import RetainedRequest, RetentionBuffer

logger = logging.getLogger("specserve.adaptation")


def _run_task(source, current, domain, records, config, num_threads):
    """:func:`adaptation.candidate.run` in a task of its own (its CPUs bounded)."""
    import torch

    torch.set_num_threads(num_threads)
    return run(source, current, domain, records, config, log=logger.info)


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=10,
)
class AdaptationDeployment:
    """Holds the application's :class:`RetentionBuffer` and draft versions; see the
    module docstring."""

    async def __init__(self, config: dict[str, Any], draft: dict[str, Any] | None = None):
        self.config = AdaptationConfig.model_validate(config)
        self.buffer = RetentionBuffer(self.config.retention)
        # Expired requests leave memory and disk even in domains nobody sends to.
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        self.source = None if draft is None else DraftSource(**draft)
        self.version = 0  # 0: the draft as deployed
        self._weights_ref = None  # the served version's state dict, in the object store
        self._run: asyncio.Task | None = None
        self._started: dict[str, float] = {}  # domain -> when its last run started
        self.runs: list[dict[str, Any]] = []  # each run's summary, newest last
        self.outcomes = {"started": 0, "deployed": 0, "rejected": 0, "failed": 0}

    async def retain(
        self, domain: str, prompt_token_ids: list[int], output_token_ids: list[int]
    ) -> bool:
        """A replica's request that just finished; returns whether it was kept."""
        record = RetainedRequest(domain, tuple(prompt_token_ids), tuple(output_token_ids), 0.0)
        return self.buffer.add(record)  # (stamped with the buffer's clock)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.buffer.sweep_interval_s())
            try:
                self.buffer.sweep()
            except Exception:  # a full disk, say: the next sweep tries again
                logger.exception("retention sweep failed")

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

    # ----- versions -----------------------------------------------------------------------

    async def served_version(self) -> int:
        """The draft version every replica must serve (0: the deployed checkpoint)."""
        return self.version

    async def weights(self, version: int) -> list:
        """``[ObjectRef]`` of ``version``'s state dict (in a list, so that the caller
        fetches it from the object store itself); [] if that is not the version served."""
        if version != self.version or self._weights_ref is None:
            return []
        return [self._weights_ref]

    async def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "running": self._run is not None and not self._run.done(),
            "outcomes": dict(self.outcomes),
            "runs": list(self.runs),
        }

    # ----- runs ---------------------------------------------------------------------------

    async def on_drift(self, domain: str) -> bool:
        """A replica saw the drift alert fire for ``domain``: start a run unless one is
        running, runs on drift are off, or the domain has too few requests. Returns
        whether a run started."""
        if not self.config.trainer.on_drift or (self._run is not None and not self._run.done()):
            return False
        # Every replica reports the same alert: one run per domain per cooldown.
        cooldown = max(60.0, self.config.trainer.max_seconds)
        if time.monotonic() - self._started.get(domain, -cooldown) < cooldown:
            return False
        if len(self.buffer.records(domain)) < self.config.trainer.min_requests:
            logger.info("adaptation: drift on %r, but too few requests retained to train", domain)
            return False
        self._run = asyncio.get_running_loop().create_task(self.adapt(domain))
        return True

    async def adapt(self, domain: str) -> dict[str, Any]:
        """Train, validate and (if it is better) deploy a draft for ``domain`` now;
        returns the run's summary (verdict, scores before and after, training)."""
        if self.source is None:
            raise RuntimeError("this application serves no draft model: nothing to adapt")
        domains = {d: self.buffer.records(d) for d in self.buffer.summary()}
        if len(domains.get(domain, ())) < 2:
            raise ValueError(f"domain {domain!r} has fewer than 2 retained requests")
        cfg = self.config.trainer
        self.outcomes["started"] += 1
        self._started[domain] = time.monotonic()
        task = ray.remote(_run_task).options(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
        current = self._weights_ref  # resolved by Ray into the state dict in the task
        try:
            result = await task.remote(self.source, current, domain, domains, cfg, cfg.num_threads)
        except Exception as exc:
            self.outcomes["failed"] += 1
            self._note({"domain": domain, "outcome": "failed", "error": repr(exc)[:500]})
            raise
        summary = result.summary()
        if result.verdict.deploy:
            self._weights_ref = ray.put(result.weights)
            self.version += 1
            self.outcomes["deployed"] += 1
            summary["version"] = self.version
        else:
            self.outcomes["rejected"] += 1
        summary["outcome"] = "deployed" if result.verdict.deploy else "rejected"
        self._note(summary)
        return summary

    def _note(self, summary: dict[str, Any]) -> None:
        logger.info("adaptation run: %s", summary)
        self.runs = [*self.runs[-19:], summary]
