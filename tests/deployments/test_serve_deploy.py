"""`serve deploy cluster/serve/demo.yaml` on a running local cluster reaches RUNNING and answers."""

import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.conftest import ROOT, free_port


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
    deadline = time.monotonic() + 300
    status = ""
    while time.monotonic() < deadline:
        status = subprocess.run(
            [serve_cli, "status", "-a", dashboard],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        app = (yaml.safe_load(status) or {}).get("applications", {}).get("specserve", {})
        if app.get("status") == "RUNNING":
            break
        assert app.get("status") != "DEPLOY_FAILED", status
        time.sleep(2)
    assert "RUNNING" in status, status
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
