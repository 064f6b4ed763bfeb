"""Pure functions from :class:`EngineConfig` to Ray placement-group bundles.

Bundle 0 is the engine replica itself (Ray Serve puts the replica actor in the first
bundle), bundle 1 the target worker, bundle 2 the draft worker. Keeping this pure makes
placement unit-testable without a cluster, as Ray Serve LLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.config import EngineConfig, WorkerResources

ENGINE_BUNDLE = 0
TARGET_BUNDLE = 1
DRAFT_BUNDLE = 2


def bundle(res: WorkerResources) -> dict[str, float]:
    """One placement-group bundle: CPU/GPU plus custom and accelerator resources."""
    out: dict[str, float] = {}
    if res.num_cpus:
        out["CPU"] = res.num_cpus
    if res.num_gpus:
        out["GPU"] = res.num_gpus
    out.update(res.resources)
    if res.accelerator_type:
        # Ray's convention: a tiny amount of the accelerator_type resource pins the node.
        out[f"accelerator_type:{res.accelerator_type}"] = 0.001
    if not out:
        out["CPU"] = 0.001  # Ray rejects empty bundles
    return out


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]
    strategy: str
    target_bundle: int
    draft_bundle: int | None


def placement_for(config: EngineConfig) -> Placement:
    """Bundles and strategy for one engine replica and its workers.

    With STRICT_SPREAD Ray puts every bundle on a different node; the engine bundle then
    needs a third node, so we drop the replica's own resources into the target's node by
    folding it into the target bundle when the user asked only for draft/target apart.
    """
    engine = bundle(config.engine_resources)
    target = bundle(config.target_resources)
    if config.draft is None:
        return Placement([engine, target], config.placement_strategy, TARGET_BUNDLE, None)
    draft = bundle(config.draft_resources)
    if config.placement_strategy == "STRICT_SPREAD":
        merged = dict(target)
        for key, value in engine.items():
            merged[key] = merged.get(key, 0) + value
        # [engine + target] on one node, [draft] on another.
        return Placement([merged, draft], "STRICT_SPREAD", 0, 1)
    return Placement(
        [engine, target, draft], config.placement_strategy, TARGET_BUNDLE, DRAFT_BUNDLE
    )
