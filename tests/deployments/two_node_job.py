"""Run by test_two_node.py in its own process: connect to the two-node cluster, place the
target and the draft on their labelled nodes (STRICT_SPREAD), generate, print JSON."""

import asyncio
import json
import sys

import ray
from ray.util.placement_group import placement_group

from deployments.config import EngineConfig
from deployments.frontend.engine_client import EngineClient
from deployments.placement import placement_for
from specdec.sampling import SamplingParams


async def main(address: str, target: str, draft: str) -> None:
    ray.init(address=address, log_to_driver=False)
    cfg = EngineConfig.model_validate(
        {
            "target": {"model": target, "execution_mode": "eager"},
            "draft": {"model": draft, "execution_mode": "eager"},
            "placement_strategy": "STRICT_SPREAD",
            "engine_resources": {"num_cpus": 0},
            "target_resources": {"num_cpus": 1, "resources": {"target": 1}},
            "draft_resources": {"num_cpus": 1, "resources": {"draft": 1}},
        }
    )
    placement = placement_for(cfg)
    pg = placement_group(placement.bundles, strategy=placement.strategy)
    await pg.ready()
    engine = EngineClient(cfg, placement_group=pg)
    await engine.start()
    tokens, stats = [], None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    async for out in engine.generate([30, 31, 32, 33, 34], params):
        tokens += out.new_token_ids
        stats = out.stats
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    print(
        json.dumps(
            {
                "target_node": engine.target_info["node_id"],
                "draft_node": engine.draft_info["node_id"],
                "target_node_resources": nodes[engine.target_info["node_id"]],
                "draft_node_resources": nodes[engine.draft_info["node_id"]],
                "tokens": tokens,
                "drafted": stats.drafted,
            }
        )
    )
    await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
