"""Creating the engine's worker actors and waiting for them to load.

What each worker asks Ray for comes from config (``*_resources``) and the replica's
placement group (:func:`deployments.placement.placement_for` picks the bundle); nothing
here decides when a worker is replaced —
:class:`deployments.frontend.engine_client.EngineClient` does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import EngineConfig, WorkerResources
from deployments.core.engine_core import EngineCore
from deployments.messages import (
    ColocatedDraftConfig,
    DraftWorkerConfig,
    EngineCoreConfig,
    RankConfig,
)
from deployments.placement import placement_for
from deployments.workers.draft_worker import DraftWorker
from deployments.workers.tensor_parallel_rank import TensorParallelRank
from specdec.policy import LengthPolicyConfig
from specdec.proposer_choice import ProposerChoiceConfig
from specdec.speculation_gate import GateConfig

logger = logging.getLogger("specserve.engine")

LOAD_LOG_PERIOD_S = 30.0  # how often a slow model load is reported in the logs


class WorkerLauncher:
    """Spawns the core (target + round loop, and a colocated draft) and the draft actor."""

    def __init__(self, config: EngineConfig, placement_group=None, tokenizer=None):
        self.config = config
        self.placement = placement_for(config)
        self.pg = placement_group
        self.tokenizer = tokenizer
        # The core adds the EOS ids of the model's generation_config to these.
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = [eos] if isinstance(eos, int) else []
        # The current other ranks (tensor parallel) of each split model, by role.
        self._ranks: dict[str, list[Any]] = {"target": [], "draft": []}

    @property
    def ranks(self) -> list[Any]:
        """The current target's and draft's other ranks (empty for whole models)."""
        return [*self._ranks["target"], *self._ranks["draft"]]

    @property
    def colocated(self) -> bool:
        """The draft runs in the core's process (config ``draft_placement``)."""
        return self.config.draft is not None and self.config.draft_placement == "colocated"

    def options(self, res: WorkerResources, bundle_index: int | None) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "num_cpus": res.num_cpus,
            "num_gpus": res.num_gpus,
            "resources": dict(res.resources) or None,
        }
        if res.accelerator_type:
            opts["accelerator_type"] = res.accelerator_type
        if self.pg is not None and bundle_index is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=bundle_index
            )
        return opts

    def spawn_target(self, draft_max_model_len: int | None, telemetry: bool):
        """The :class:`EngineCore` actor; ``draft_max_model_len``: the loaded draft's, if
        known (else the configured one)."""
        cfg = self.config
        if draft_max_model_len is None and cfg.draft is not None:
            draft_max_model_len = cfg.draft.max_model_len
        ranks = self.spawn_ranks()
        return (
            ray.remote(concurrency_groups=EngineCore.CONCURRENCY_GROUPS)(EngineCore)
            .options(**self.options(cfg.target_resources, self.placement.target_bundle))
            .remote(
                EngineCoreConfig(
                    spec=cfg.target.model_dump(),
                    max_num_seqs=cfg.scheduler.max_num_seqs,
                    eos_token_ids=self.eos_token_ids,
                    draft_timeout_s=cfg.faults.draft_timeout_s,
                    draft_max_model_len=draft_max_model_len,
                    transport=cfg.transport,
                    direct_channel=cfg.direct_channel,
                    length_policy=self._length_policy(),
                    telemetry=telemetry,
                    colocated_draft=self._colocated_draft(),
                    cpu_affinity=cfg.target_resources.cpu_affinity,
                    proposer_choice=self._proposer_choice(),
                    ngram_max=cfg.speculation.ngram_max,
                    ngram_min=cfg.speculation.ngram_min,
                    ranks=ranks,
                    rank_timeout_s=cfg.faults.rank_timeout_s,
                )
            )
        )

    def spawn_ranks(self, role: str = "target") -> list[Any]:
        """A split model's ranks 1 .. N - 1 (``role``: "target" or "draft"), each in its
        bundle with that model's resources (none for a whole model), the last worker's
        killed first. Its worker (the core, the draft worker) joins them as it loads."""
        cfg = self.config
        spec, resources = getattr(cfg, role), getattr(cfg, f"{role}_resources")
        self.kill_ranks(role)  # a replaced worker's: dead with it, or hung in a pass
        p = self.placement
        bundles = p.rank_bundles if role == "target" else p.draft_rank_bundles
        if self.pg is None:
            bundles = (None,) * (spec.tensor_parallel_size - 1)
        self._ranks[role] = [
            ray.remote(TensorParallelRank)
            .options(**self.options(resources, bundle_index))
            .remote(
                RankConfig(
                    spec=spec.model_dump(),
                    rank=rank,
                    world_size=spec.tensor_parallel_size,
                    max_num_seqs=self._kv_slots(role),
                    timeout_s=cfg.faults.rank_timeout_s,
                    cpu_affinity=None,
                    verifies=role == "target",
                    role=role,
                )
            )
            for rank, bundle_index in enumerate(bundles, start=1)
        ]
        return self._ranks[role]

    def kill_ranks(self, role: str) -> None:
        """End the role's current ranks (a draft that failed to start leaves its own)."""
        for old in self._ranks[role]:
            ray.kill(old, no_restart=True)
        self._ranks[role] = []

    def _kv_slots(self, role: str) -> int:
        """The KV slots the role's worker loads its runner with (a draft actor's hold its
        speculation branches too): each of its ranks loads as many."""
        slots = self.config.scheduler.max_num_seqs
        if role == "draft":
            return DraftWorker.kv_slots(slots, self.config.speculation.speculation_width)
        return slots

    def _proposer_choice(self) -> ProposerChoiceConfig | None:
        """The per-domain proposer choice, where some request may use it: policy
        'goodput' with more than one proposer listed."""
        spec = self.config.speculation
        if spec.policy != "goodput" or len(spec.proposers) < 2:
            return None
        return ProposerChoiceConfig()

    def spawn_draft(self):
        cfg = self.config
        spec = cfg.speculation
        return (
            ray.remote(concurrency_groups=DraftWorker.CONCURRENCY_GROUPS)(DraftWorker)
            .options(**self.options(cfg.draft_resources, self.placement.draft_bundle))
            .remote(
                DraftWorkerConfig(
                    ranks=self.spawn_ranks("draft"),
                    rank_timeout_s=cfg.faults.rank_timeout_s,
                    spec=cfg.draft.model_dump(),
                    max_num_seqs=cfg.scheduler.max_num_seqs,
                    speculation_width=spec.speculation_width,
                    overlap=spec.mode == "overlap",
                    adaptive_overlap=spec.adaptive_overlap,
                    transport=cfg.transport,
                    min_confidence=spec.draft_confidence_threshold,
                    cpu_affinity=cfg.draft_resources.cpu_affinity,
                )
            )
        )

    def _colocated_draft(self) -> ColocatedDraftConfig | None:
        if not self.colocated:
            return None
        return ColocatedDraftConfig(
            spec=self.config.draft.model_dump(),
            min_confidence=self.config.speculation.draft_confidence_threshold,
            tokenizer_size=len(self.tokenizer) if self.tokenizer is not None else None,
        )

    def _length_policy(self) -> LengthPolicyConfig | None:
        spec = self.config.speculation
        if spec.policy != "goodput" or self.config.draft is None:
            return None
        k = spec.num_speculative_tokens
        return LengthPolicyConfig(
            max_k=k,
            default_k=k,
            probe_every=spec.policy_probe_every,
            gate=GateConfig() if spec.policy_gate else None,
            disable_by_batch_size=spec.disable_by_batch_size,
        )

    async def load(self, workers: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Each worker's ``ready`` info, all awaited at once; the first failure ends the
        wait (the others are cancelled: a draft that fails in seconds does not wait for a
        target that loads for minutes). Failed workers map to their exception; slow loads
        are logged every ``LOAD_LOG_PERIOD_S``."""
        started = time.monotonic()
        tasks = {
            name: asyncio.ensure_future(ready_within(actor, timeout_s))
            for name, actor in workers.items()
        }
        pending = set(tasks.values())
        try:
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=LOAD_LOG_PERIOD_S, return_when=asyncio.FIRST_EXCEPTION
                )
                if any(t.exception() is not None for t in done):
                    break
                if pending:
                    loading = [n for n, t in tasks.items() if t in pending]
                    logger.info(
                        "still loading %s (%.0f s of at most %.0f s)",
                        " and ".join(f"{n} {getattr(self.config, n).model}" for n in loading),
                        time.monotonic() - started,
                        timeout_s,
                    )
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        out = {}
        for name, task in tasks.items():
            if task.cancelled():
                continue
            exc = task.exception()
            out[name] = exc if exc is not None else task.result()
            if exc is None:
                logger.info(
                    "%s %s loaded on node %s (%s) after %.1f s",
                    name,
                    getattr(self.config, name).model,
                    out[name]["node_id"],
                    out[name]["device"],
                    time.monotonic() - started,
                )
        return out


def startup_cause(exc: BaseException, timeout_s: float) -> str:
    """What made a worker fail to start, in one line (a Ray task error's cause, not its
    remote traceback)."""
    if isinstance(exc, asyncio.TimeoutError):
        return f"not loaded within faults.startup_timeout_s = {timeout_s:.0f} s"
    cause = getattr(exc, "cause", None) or exc
    text = f"{type(cause).__name__}: {cause}"
    return text.strip().splitlines()[-1] if "Traceback" in text else text.strip()


async def ready_within(actor, timeout_s: float) -> dict[str, Any]:
    """The worker's ``ready`` answer, or ``TimeoutError`` after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        return await actor.ready.remote()
