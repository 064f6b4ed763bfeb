"""Pure functions from :class:`EngineConfig` to Ray placement-group bundles.

Ray Serve puts the replica actor in bundle 0 of its placement group. With PACK and
SPREAD, bundle 0 is the engine replica's own, bundle 1 the target worker's, bundle 2 the
draft worker's. With STRICT_SPREAD the engine shares bundle 0 with the target (see
:func:`placement_for`). In every strategy the replica claims only the engine's resources
(:func:`replica_actor_options`), so what is left of its bundle is exactly the worker's.
Keeping this pure makes placement unit-testable without a cluster, as Ray Serve LLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.config import EngineConfig, WorkerResources

ENGINE_BUNDLE = 0
TARGET_BUNDLE = 1
DRAFT_BUNDLE = 2


def bundle(res: WorkerResources) -> dict[str, float]:
    """One placement-group bundle: CPU/GPU plus custom and accelerator resources."""
    return _claim(res) or {"CPU": 0.001}  # Ray rejects empty bundles


def _claim(res: WorkerResources) -> dict[str, float]:
    """What an actor with these resources reserves (empty when it asks for nothing)."""
    out: dict[str, float] = {}
    if res.num_cpus:
        out["CPU"] = res.num_cpus
    if res.num_gpus:
        out["GPU"] = res.num_gpus
    out.update(res.resources)
    if res.accelerator_type:
        # Ray's convention: a tiny amount of the accelerator_type resource pins the node.
        out[f"accelerator_type:{res.accelerator_type}"] = 0.001
    return out


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]
    strategy: str
    target_bundle: int
    draft_bundle: int | None
    # The target's ranks 1 .. N - 1 (target.tensor_parallel_size), after the others.
    rank_bundles: tuple[int, ...] = ()
    # A split draft's ranks 1 .. M - 1 (draft.tensor_parallel_size), after the target's.
    draft_rank_bundles: tuple[int, ...] = ()


def placement_for(config: EngineConfig) -> Placement:
    """Bundles and strategy for one engine replica and its workers (a tensor-parallel
    target's other ranks after them, each with the target's resources, then a split
    draft's, each with the draft's; PACK keeps ranks with their worker).

    With STRICT_SPREAD Ray puts every bundle on a different node; the engine bundle then
    needs a third node, so we drop the replica's own resources into the target's node by
    folding it into the target bundle when the user asked only for draft/target apart.
    The replica still claims only the engine's share of that bundle
    (:func:`replica_actor_options`); the rest is the target's.
    """
    placement = _workers(config)
    bundles = list(placement.bundles)

    def ranks_of(size: int, resources: WorkerResources) -> tuple[int, ...]:
        first = len(bundles)
        bundles.extend([bundle(resources)] * (size - 1))
        return tuple(range(first, len(bundles)))

    target_ranks = ranks_of(config.target.tensor_parallel_size, config.target_resources)
    draft_ranks = ()
    if placement.draft_bundle is not None:  # (a draft actor: one to split)
        draft_ranks = ranks_of(config.draft.tensor_parallel_size, config.draft_resources)
    return Placement(
        bundles,
        placement.strategy,
        placement.target_bundle,
        placement.draft_bundle,
        target_ranks,
        draft_ranks,
    )


def _workers(config: EngineConfig) -> Placement:
    """The engine's, the target's (its rank 0) and the draft's bundles."""
    engine = bundle(config.engine_resources)
    target = bundle(config.target_resources)
    if config.draft is None or config.draft_placement == "colocated":  # no draft actor
        return Placement([engine, target], config.placement_strategy, TARGET_BUNDLE, None)
    draft = bundle(config.draft_resources)
    if config.placement_strategy == "STRICT_SPREAD":
        merged = dict(target)
        for key, value in _claim(config.engine_resources).items():
            merged[key] = merged.get(key, 0) + value
        # [engine + target] on one node, [draft] on another.
        return Placement([merged, draft], "STRICT_SPREAD", 0, 1)
    return Placement(
        [engine, target, draft], config.placement_strategy, TARGET_BUNDLE, DRAFT_BUNDLE
    )


def replica_actor_options(config: EngineConfig) -> dict[str, Any]:
    """``ray_actor_options`` of the Serve replica: the engine's resources, nothing more.

    Never derived from bundle 0: with STRICT_SPREAD that bundle also holds the target's
    share (its GPU), and a replica that claimed it would leave the target unschedulable.
    """
    res = config.engine_resources
    options: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus}
    if res.resources:
        options["resources"] = dict(res.resources)
    if res.accelerator_type:
        # Ray turns this into 0.001 of `accelerator_type:<type>`, as bundle() reserves.
        options["accelerator_type"] = res.accelerator_type
    return options
