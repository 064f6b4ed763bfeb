"""A real local Ray instance for the engine tests (no mocked Ray)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def two_node_cluster():
    """A separate two-node Ray cluster (cluster/local_cluster.sh) with a dashboard.

    Yields (GCS address, environment for its clients, dashboard URL). It runs beside the
    test session's own Ray instance and is stopped without touching it.
    """
    dashboard = free_port()
    env = {
        **os.environ,
        "RAY": str(Path(sys.executable).parent / "ray"),
        "SPECSERVE_RAY_PORT": str(free_port()),
        "SPECSERVE_DASHBOARD_PORT": str(dashboard),
        "SPECSERVE_RAY_TEMP_DIR": f"/tmp/specserve-test-{os.getpid()}",
        "RAY_AUTH_MODE": "token",
        "PYTHONPATH": str(ROOT),
    }
    script = ROOT / "cluster" / "local_cluster.sh"
    address = subprocess.run(
        [str(script), "start"], env=env, check=True, capture_output=True, text=True, timeout=180
    ).stdout.strip()
    try:
        yield address, env, f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([str(script), "stop"], env=env, timeout=60, check=False)
