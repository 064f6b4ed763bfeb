"""Every shipped serve config validates against the one schema (AppConfig)."""

from pathlib import Path

import pytest
import yaml

from deployments.config import AppConfig
from deployments.placement import placement_for

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def serve_configs():
    for path in sorted((CLUSTER / "serve").glob("*.yaml")):
        yield path.name, yaml.safe_load(path.read_text())
    manifest = yaml.safe_load((CLUSTER / "kuberay-rayservice.yaml").read_text())
    yield "kuberay-rayservice.yaml", yaml.safe_load(manifest["spec"]["serveConfigV2"])


@pytest.mark.parametrize(("name", "config"), list(serve_configs()))
def test_serve_config_args_validate(name, config):
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = AppConfig.model_validate(app["args"])
    assert cfg.engine.draft is not None, f"{name} should configure a draft"
    placement = placement_for(cfg.engine)
    if cfg.engine.draft_placement == "colocated":  # the draft runs in the target's bundle
        assert placement.draft_bundle is None and len(placement.bundles) == 2, name
    else:
        assert placement.draft_bundle is not None, f"{name} should place a draft actor"


def test_kuberay_splits_the_target_and_pins_each_worker_to_its_node_group():
    """The manifest's app: a 70B target over four ranks, each asking for a `target` node's
    resource, and the draft for a `draft` node's; PACK (the ranks share a node)."""
    manifest = yaml.safe_load((CLUSTER / "kuberay-rayservice.yaml").read_text())
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    cfg = AppConfig.model_validate(args)
    assert cfg.engine.placement_strategy == "PACK"
    assert cfg.engine.target.tensor_parallel_size == 4
    assert len(placement_for(cfg.engine).rank_bundles) == 3
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert "target" in groups["target-gpu"]["rayStartParams"]["resources"]
    assert "draft" in groups["draft-gpu"]["rayStartParams"]["resources"]
    target_node = groups["target-gpu"]["template"]["spec"]["containers"][0]["resources"]
    assert int(target_node["limits"]["nvidia.com/gpu"]) >= cfg.engine.target.tensor_parallel_size
    assert cfg.engine.target_resources.resources == {"target": 1}
    assert cfg.engine.draft_resources.resources == {"draft": 1}
    # The draft's GPU is no slower than the target's (README, "Sizing the draft's device").
    selectors = {n: g["template"]["spec"]["nodeSelector"] for n, g in groups.items()}
    assert selectors["draft-gpu"] == selectors["target-gpu"]


def test_ray_cluster_yaml_labels_node_types():
    cluster = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert (
        "target" in types["target_gpu"]["resources"] and "draft" in types["draft_gpu"]["resources"]
    )
