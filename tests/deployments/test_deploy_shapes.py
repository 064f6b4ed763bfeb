"""Every committed serve config deploys through ``serve deploy`` on the local cluster
(``cluster/local_cluster.sh``: a head, a worker node that offers a ``target`` resource and
one that offers a ``draft`` resource), with the shape it ships: its placement strategy, its
custom resources, GPUs replaced by the custom resource of the node they stand for.

For each of ``cluster/serve/*.yaml`` and the KubeRay manifest's ``serveConfigV2``: the app
becomes RUNNING and answers a completion (with eager models: this test is about placement;
``demo.yaml``'s engine as shipped, compiled, serves the client tests); the replica reserves
exactly the engine's resources and the target and draft workers their own;
each worker runs on the node its resources name, and STRICT_SPREAD puts draft and target on
different nodes.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deployments.config import AppConfig, WorkerResources
from deployments.placement import placement_for
from tests.conftest import EAGER, ROOT, free_port
from tests.deployments.test_cluster_configs import serve_configs

SERVE = str(Path(sys.executable).parent / "serve")
CONFIGS = list(serve_configs())
DEMO = yaml.safe_load((ROOT / "cluster" / "serve" / "demo.yaml").read_text())
DEMO_ENGINE = DEMO["applications"][0]["args"]["engine"]
# Custom resources the local nodes offer, one per worker role (cluster/local_cluster.sh).
NODE_RESOURCE = {"target": "target", "draft": "draft"}


def local_resources(res: dict[str, Any], role: str | None, max_cpus: float) -> dict[str, Any]:
    """A worker's resources on the CPU-only local cluster: a GPU (or an accelerator type)
    becomes the custom resource of the node type it stands for, unless the config already
    pins the worker with custom resources of its own; CPUs are capped to fit 2 cores."""
    out = dict(res)
    gpus = out.pop("num_gpus", 0)
    accelerator = out.pop("accelerator_type", None)
    custom = dict(out.get("resources") or {})
    if (gpus or accelerator) and not custom:
        if role is None:
            raise AssertionError("the engine replica itself should not need a GPU")
        custom = {NODE_RESOURCE[role]: gpus or 1}
    if custom:
        out["resources"] = custom
    out["num_cpus"] = min(out.get("num_cpus", 1.0), max_cpus)
    return out


def local_shape(config: dict[str, Any], port: int) -> dict[str, Any]:
    """The config as a user would adapt it to this machine: the demo pair instead of the
    hub models, GPUs as custom resources, one replica and small batches, free ports."""
    config = copy.deepcopy(config)
    # Both local nodes share one host, so only one HTTP proxy can bind the port.
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (app,) = config["applications"]
    args = app["args"]
    engine = args["engine"]
    args["monitoring"] = {**args.get("monitoring", {}), "prometheus_port": free_port()}
    if not args.get("adaptation", {}).get("retention", {}).get("enabled"):
        args["monitoring"]["enabled"] = False  # (a process fewer; adaptation needs it)
    # eager: these deployments are about placement (demo.yaml's engine as shipped, compiled,
    # serves the client tests: tests/clients/conftest.py);
    # a split target stays split (the demo target's 4 heads split over 2 or 4 ranks)
    ranks = engine["target"].get("tensor_parallel_size", 1)
    engine["target"] = {**DEMO_ENGINE["target"], **EAGER, "tensor_parallel_size": ranks}
    engine["draft"] = {**DEMO_ENGINE["draft"], **EAGER}
    engine["engine_resources"] = local_resources(engine.get("engine_resources", {}), None, 0.5)
    for role, count in (("target", ranks), ("draft", 1)):
        key = f"{role}_resources"  # (a split target's ranks share a 2-core node)
        engine[key] = local_resources(engine.get(key, {}), role, 1.0 / count)
    scheduler = engine.setdefault("scheduler", {})
    scheduler["max_num_seqs"] = min(scheduler.get("max_num_seqs", 4), 4)
    args.pop("autoscaling_config", None)
    args["num_replicas"] = 1
    AppConfig.model_validate(args)  # still a valid config
    return config


def claim(res: dict[str, Any]) -> dict[str, float]:
    """What Ray reserves for an actor with these WorkerResources."""
    r = WorkerResources.model_validate(res)
    out = {"CPU": r.num_cpus, "GPU": r.num_gpus, **r.resources}
    return {k: v for k, v in out.items() if v}


def serve_cli(env, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([SERVE, *args], env=env, cwd=ROOT, timeout=120, **kw)


class Dashboard:
    """The cluster's dashboard REST API, as `serve status` and `ray list` call it (with the
    cluster's token), without starting a Python process per call."""

    def __init__(self, url: str, env: dict[str, str]):
        token = Path(env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    def apps(self) -> dict[str, Any]:
        """Serve's applications by name, with their status."""
        r = self.http.get("/api/serve/applications/")
        r.raise_for_status()
        return r.json().get("applications") or {}

    def app_status(self, name: str) -> dict[str, Any]:
        return self.apps().get(name, {})

    def wait_running(self, name: str, timeout_s: float = 400) -> None:
        deadline = time.monotonic() + timeout_s
        app: dict[str, Any] = {}
        while time.monotonic() < deadline:
            app = self.app_status(name)
            if app.get("status") == "RUNNING":
                return
            assert app.get("status") != "DEPLOY_FAILED", app
            time.sleep(0.5)
        raise AssertionError(f"{name} not RUNNING after {timeout_s} s: {app}")

    def delete_apps(self, http_port: int, timeout_s: float = 120) -> None:
        """Every app deleted (a declarative config without apps, as ``serve deploy`` sends
        it), the controller and proxy kept for the next config: ``serve shutdown`` would
        stop them, and each config would start them again."""
        body = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [],
        }
        self.http.put("/api/serve/applications/", json=body).raise_for_status()
        deadline = time.monotonic() + timeout_s
        while (apps := self.apps()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not apps, f"apps left after {timeout_s} s: {list(apps)}"

    def state(self, resource: str, **filters: str) -> list[dict[str, Any]]:
        """The state API (ray.util.state.list_*), detailed, filtered by equality."""
        params: dict[str, Any] = {"detail": True, "limit": 10_000}
        params["filter_keys"] = list(filters)
        params["filter_predicates"] = ["="] * len(filters)
        params["filter_values"] = list(filters.values())
        r = self.http.get(f"/api/v0/{resource}", params=params)
        r.raise_for_status()
        return r.json()["data"]["result"]["result"]


# Inside a placement group Ray asks for `<resource>_group_<bundle>_<pg>` (plus the same
# without the bundle index, and 0.001 of a `bundle` marker): the plain name is what the
# actor's options said.
_IN_BUNDLE = re.compile(r"^(?P<name>.+)_group_(?P<bundle>\d+)_[0-9a-f]+$")


def reservation(actor: dict[str, Any]) -> tuple[dict[str, float], int]:
    """(what the actor asked for, its bundle index) from its state-API record."""
    resources, bundles = {}, set()
    for key, value in actor["required_resources"].items():
        m = _IN_BUNDLE.match(key)
        if m and m["name"] != "bundle":
            resources[m["name"]] = value
            bundles.add(int(m["bundle"]))
    (bundle,) = bundles
    return resources, bundle


def placed_actors(dashboard: Dashboard, app_name: str) -> dict[str, dict[str, Any]]:
    """The app's replica, its target and draft workers and a split target's other ranks
    (``rank-0`` ...): node, node resources, placement group, bundle and reserved resources
    of each (the replica's workers share its group)."""
    nodes = {n["node_id"]: n["resources_total"] for n in dashboard.state("nodes", state="ALIVE")}
    actors = dashboard.state("actors", state="ALIVE")
    # Deployment `SpecServe` (build_specserve_app's default name), not its monitor.
    (replica,) = [a for a in actors if a["class_name"] == f"ServeReplica:{app_name}:SpecServe"]
    pg = replica["placement_group_id"]
    found = {"replica": replica}
    for role, cls in (("target", "EngineCore"), ("draft", "DraftWorker")):
        mine = [a for a in actors if a["class_name"] == cls and a["placement_group_id"] == pg]
        if mine or role == "target":  # (a colocated draft has no actor of its own)
            (found[role],) = mine
    ranks = [
        a
        for a in actors
        if a["class_name"] == "TensorParallelRank" and a["placement_group_id"] == pg
    ]
    for i, actor in enumerate(ranks):
        found[f"rank-{i}"] = actor
    out = {}
    for role, actor in found.items():
        resources, bundle = reservation(actor)
        out[role] = {
            "node_id": actor["node_id"],
            "node_resources": nodes[actor["node_id"]],
            "placement_group_id": actor["placement_group_id"],
            "bundle": bundle,
            "resources": resources,
        }
    return out


@pytest.fixture(scope="module")
def dashboard(two_node_cluster):
    _address, env, url = two_node_cluster
    return Dashboard(url, env)


@pytest.fixture(scope="module")
def serve_port(two_node_cluster):
    """The HTTP port of the one Serve instance every config of this module deploys to
    (a running proxy keeps its port); Serve is shut down after the last config, so that
    the cluster's other tests start their own."""
    _address, env, url = two_node_cluster
    yield free_port()
    serve_cli(env, "shutdown", "-y", "-a", url, check=False)


@pytest.mark.parametrize(("name", "config"), CONFIGS, ids=[name for name, _ in CONFIGS])
def test_committed_config_deploys_with_its_shape(
    two_node_cluster, dashboard, serve_port, tmp_path, name, config
):
    _address, env, dashboard_url = two_node_cluster
    port = serve_port
    local = local_shape(config, port)
    (app,) = local["applications"]
    engine = app["args"]["engine"]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(local))
    seconds, t0 = {}, time.monotonic()
    serve_cli(env, "deploy", str(path), "-a", dashboard_url, check=True)
    seconds["deploy"] = time.monotonic() - t0
    try:
        dashboard.wait_running(app["name"])
        seconds["running"] = time.monotonic() - t0
        model = AppConfig.model_validate(app["args"]).engine.model_name
        r = httpx.post(
            f"http://127.0.0.1:{port}{app.get('route_prefix', '/').rstrip('/')}/v1/completions",
            json={"model": model, "prompt": "def main():\n", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        placed = placed_actors(dashboard, app["name"])
        seconds["answered"] = time.monotonic() - t0
    finally:
        dashboard.delete_apps(port)
    seconds["deleted"] = time.monotonic() - t0
    print(name, json.dumps({"seconds": seconds, **placed}, indent=1))  # shown with -s

    assert health["status"] == "ok" and health["target"] and health["draft"]
    placement = placement_for(AppConfig.model_validate(app["args"]).engine)
    # The replica reserves the engine's resources in bundle 0, each worker its own in its
    # bundle of the same placement group, on the node that bundle landed on.
    replica = placed["replica"]
    assert (replica["bundle"], replica["resources"]) == (0, claim(engine["engine_resources"]))
    bundles = {"target": placement.target_bundle, "draft": placement.draft_bundle}
    # A colocated draft runs inside the target's actor: no actor, no bundle of its own.
    assert ("draft" in placed) == (placement.draft_bundle is not None)
    for role in [r for r in ("target", "draft") if r in placed]:
        actor = placed[role]
        assert actor["bundle"] == bundles[role]
        assert actor["resources"] == claim(engine[f"{role}_resources"])
        assert actor["placement_group_id"] == replica["placement_group_id"]
        # A worker pinned by a custom resource runs on a node that offers it.
        for resource in engine[f"{role}_resources"].get("resources", {}):
            assert resource in actor["node_resources"], (role, resource, actor)
    assert_ranks_placed(placed, placement.rank_bundles, engine["target_resources"])
    if placement.strategy == "STRICT_SPREAD":
        assert placed["target"]["node_id"] != placed["draft"]["node_id"]
        # The replica shares the target's bundle, hence its node.
        assert replica["node_id"] == placed["target"]["node_id"]


def assert_ranks_placed(placed: dict, rank_bundles: tuple[int, ...], resources: dict) -> None:
    """A split target's other ranks: one actor per rank bundle, with the target's
    resources, on the target's node (none for a whole target)."""
    ranks = [placed[r] for r in placed if r.startswith("rank-")]
    assert sorted(r["bundle"] for r in ranks) == list(rank_bundles)
    for rank in ranks:
        assert rank["resources"] == claim(resources)
        assert rank["node_id"] == placed["target"]["node_id"]
