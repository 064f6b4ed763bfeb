"""Benchmark and evaluation clients, unmodified, against a live SpecServe (issue 18).

The clients come from their own virtualenv, ``.venv-clients`` (``make test`` builds it from
``tests/clients/requirements.txt``): their dependencies cannot share ``.venv`` with the
project's (they pin huggingface_hub 1.x, which transformers 5.23 refuses, and older click,
rich and prometheus_client). Each test runs a client's own command line as a subprocess.

One application serves every client test: ``cluster/serve/demo.yaml``'s engine, what
``make serve`` deploys (the monitor deployment off: no client reads it), under the route
prefix ``/clients`` so that the clients are also shown to work behind a path.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from ray import serve

from deployments.app import build_specserve_app
from deployments.config import AppConfig
from deployments.smoke import wait_healthy
from tests.conftest import DEMO_TARGET, ROOT

CLIENTS_VENV = ROOT / ".venv-clients"
APP = "Clients"
PREFIX = "/clients"
MODEL = "demo-target"
# The demo's graphs from a cold compile cache on 2 loaded cores: 748 s measured (its four
# target graphs; a warm cache loads them in seconds).
WARM_UP_TIMEOUT_S = 1200


def client_exe(name: str) -> str:
    """A client's executable in ``.venv-clients``: a missing one fails the test."""
    path = CLIENTS_VENV / "bin" / name
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"{path} is missing: the client virtualenv is built by `make test` "
            "(or `make clients`) from tests/clients/requirements.txt"
        )
    return str(path)


def client_env(tmp_path: Path, *, hub_offline: bool = True) -> dict[str, str]:
    """The clients' environment: no network for models or data sets (the tokenizer is
    the demo target's directory), caches under ``tmp_path``, nothing of the project's
    Python path. ``hub_offline=False`` for AIPerf 0.13: in offline mode it looks a
    tokenizer up in the hub cache even when given a directory (and fails)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        NO_COLOR="1",
    )
    if hub_offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def run_client(
    argv: list[str], env: dict[str, str], cwd: Path, log_dir: Path | None = None, timeout=300
) -> str:
    """Run a client to completion and return its output (stdout and stderr, also kept in
    ``<log_dir or cwd>/<client>.log``); a non-zero exit fails with the output's error lines
    and its end."""
    name = Path(argv[0]).name
    log = (log_dir or cwd) / f"{name}.log"
    proc = subprocess.run(
        argv,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        errors = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
        pytest.fail(
            f"{name} exited {proc.returncode} (log: {log})\n--- error lines\n"
            + "\n".join(errors[:30])
            + f"\n--- end of output\n{proc.stdout[-4000:]}"
        )
    return proc.stdout


def demo_app_args() -> dict:
    """``cluster/serve/demo.yaml``'s application args, less the monitor deployment."""
    config = yaml.safe_load((ROOT / "cluster" / "serve" / "demo.yaml").read_text())
    args = config["applications"][0]["args"]
    args["monitoring"] = {"enabled": False}
    return args


@pytest.fixture(scope="package")
def server_url(serve_http) -> str:
    """The demo application, once for every client test; yields its base URL."""
    cfg = AppConfig.model_validate(demo_app_args())
    assert cfg.engine.target.model.endswith("demo-target")
    serve.run(build_specserve_app(config=cfg, name=APP), name=APP, route_prefix=PREFIX)
    url = f"{serve_http}{PREFIX}"
    # A running replica may still be compiling its graphs (/health: warming), and requests
    # meanwhile wait in its queue: on a cold compile cache, minutes that a client's own
    # timeout would count (an AIPerf run once timed out so). The clients start as a user's
    # do after `make serve`: once /health says ok.
    wait_healthy(url, timeout_s=WARM_UP_TIMEOUT_S)
    yield url
    serve.delete(APP)


@pytest.fixture(scope="package")
def tokenizer_path() -> str:
    return DEMO_TARGET
