"""A real local Ray instance for the engine tests (no mocked Ray)."""

import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
# The local cluster's stop, for tests/conftest.py's pytest_runtest_teardown.
LOCAL_CLUSTER_STOP = pytest.StashKey[Callable[[], None]]()


@pytest.fixture(scope="session")
def two_node_cluster(request):
    """A separate Ray cluster of several nodes (cluster/local_cluster.sh: a head, a
    ``target`` node and a ``draft`` node; tests add and stop nodes) with a dashboard.

    Yields (GCS address, environment for its clients, dashboard URL). It runs beside the
    test session's own Ray instance and is stopped without touching it: after the last
    test that uses it (its tests run one after another, tests/conftest.py run_order), not
    at the session's end, so that its idle nodes do not load the rest of the run.
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
    # The nodes run in sessions of their own, so a killed test run would leave them behind,
    # loading the machine for whatever runs next: a watchdog outside this process's session
    # stops them once this process is gone.
    subprocess.Popen(
        ["bash", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 5; done; {script} stop"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = subprocess.run(
        [str(script), "start"], env=env, check=True, capture_output=True, text=True, timeout=900
    ).stdout.strip()

    def stop() -> None:
        subprocess.run([str(script), "stop"], env=env, timeout=60, check=False)
        token.unlink(missing_ok=True)

    request.config.stash[LOCAL_CLUSTER_STOP] = stop
    try:
        yield address, env, f"http://127.0.0.1:{dashboard}"
    finally:
        stop()
