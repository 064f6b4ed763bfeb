"""`serve deploy cluster/serve/demo.yaml` on a running local cluster reaches RUNNING and answers."""

import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.conftest import ROOT, free_port
from tests.deployments.test_deploy_shapes import Dashboard


def test_serve_deploy_demo_yaml(two_node_cluster, tmp_path):
    _address, env, dashboard = two_node_cluster
    serve_cli = str(Path(sys.executable).parent / "serve")
    config = yaml.safe_load((ROOT / "cluster" / "serve" / "demo.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port  # the only changes: free ports for the test
    args = config["applications"][0]["args"]
    args["monitoring"] = {**args.get("monitoring", {}), "prometheus_port": free_port()}
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    subprocess.run(
        [serve_cli, "deploy", str(path), "-a", dashboard],
        env=env,
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    # The dashboard's REST API, as `serve status` reads it, without a Python process per
    # poll competing with the replica's compilation for the two cores.
    Dashboard(dashboard, env).wait_running("specserve", timeout_s=300)
    try:
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": "demo-target",
                "prompt": "def main():\n",
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] > 0 and body["speculation"]["drafted"] > 0
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
    finally:
        subprocess.run(
            [serve_cli, "shutdown", "-y", "-a", dashboard], env=env, timeout=120, check=False
        )
