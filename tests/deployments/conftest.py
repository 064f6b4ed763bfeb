"""A real local Ray instance for the engine tests (no mocked Ray)."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def two_node_cluster():
    """A separate Ray cluster of several nodes (cluster/local_cluster.sh: a head, a
    ``target`` node and a ``draft`` node; tests add and stop nodes) with a dashboard.

    Yields (GCS address, environment for its clients, dashboard URL). It runs beside the
    test session's own Ray instance and is stopped without touching it.
    """
    dashboard = free_port()
    temp_dir = f"/tmp/specserve-test-{os.getpid()}"
    # Ray 2.60's `ray start` with token auth needs a token it does not create itself
    # (only a local ray.init writes ~/.ray/auth_token): give the cluster its own.
    token = Path(f"{temp_dir}-auth_token")
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {
        **os.environ,
        "RAY": str(Path(sys.executable).parent / "ray"),
        "SPECSERVE_RAY_PORT": str(free_port()),
        "SPECSERVE_DASHBOARD_PORT": str(dashboard),
        "SPECSERVE_RAY_TEMP_DIR": temp_dir,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the file
    script = ROOT / "cluster" / "local_cluster.sh"
    address = subprocess.run(
        [str(script), "start"], env=env, check=True, capture_output=True, text=True, timeout=900
    ).stdout.strip()
    try:
        yield address, env, f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([str(script), "stop"], env=env, timeout=60, check=False)
        token.unlink(missing_ok=True)
