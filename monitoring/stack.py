"""Prometheus and Alertmanager for a running SpecServe app, on loopback.

    python -m monitoring.stack --monitor 127.0.0.1:9464     # what `make observe` runs

Renders ``monitoring/prometheus/prometheus.yml`` for the given monitor address, ports and
intervals into a work directory (``alerts.yml`` beside it), starts Debian's
``prometheus`` and ``prometheus-alertmanager`` there, waits until both answer, prints
their URLs and keeps them running until interrupted. Tests use :class:`Stack` directly
(``tests/monitoring/test_drift_e2e.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PROM_DIR = Path(__file__).resolve().parent / "prometheus"
MONITOR_PLACEHOLDER = "127.0.0.1:9464"
ALERTMANAGER_PLACEHOLDER = "127.0.0.1:9093"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(
        f"none of {names} on PATH: install Debian's prometheus and prometheus-alertmanager "
        "(`make monitoring-tools`)"
    )


def render_prometheus_config(monitor: str, alertmanager: str, interval_s: float) -> str:
    """prometheus.yml with the monitor and Alertmanager addresses and both intervals set."""
    text = (PROM_DIR / "prometheus.yml").read_text()
    for placeholder, value in (
        (MONITOR_PLACEHOLDER, monitor),
        (ALERTMANAGER_PLACEHOLDER, alertmanager),
    ):
        target = f'targets: ["{placeholder}"]'
        if text.count(target) != 1:
            raise ValueError(f"prometheus.yml must have {target} exactly once")
        text = text.replace(target, f'targets: ["{value}"]')
    every = f"{interval_s:g}s"
    text = text.replace("scrape_interval: 5s", f"scrape_interval: {every}")
    return text.replace("evaluation_interval: 5s", f"evaluation_interval: {every}")


def _get_json(url: str, timeout_s: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


@dataclass
class Stack:
    """A Prometheus + Alertmanager pair scraping ``monitor`` (``host:port``)."""

    monitor: str
    interval_s: float = 5.0
    workdir: Path | None = None
    prometheus_port: int = field(default_factory=free_port)
    alertmanager_port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    @property
    def alertmanager_url(self) -> str:
        return f"http://127.0.0.1:{self.alertmanager_port}"

    def start(self, timeout_s: float = 60.0) -> Stack:
        work = Path(self.workdir or tempfile.mkdtemp(prefix="specserve-stack-"))
        work.mkdir(parents=True, exist_ok=True)
        self.workdir = work
        shutil.copy(PROM_DIR / "alerts.yml", work / "alerts.yml")
        shutil.copy(PROM_DIR / "alertmanager.yml", work / "alertmanager.yml")
        am_addr = f"127.0.0.1:{self.alertmanager_port}"
        (work / "prometheus.yml").write_text(
            render_prometheus_config(self.monitor, am_addr, self.interval_s)
        )
        am = find_binary("prometheus-alertmanager", "alertmanager")
        prom = find_binary("prometheus")
        cluster_port = free_port()  # Alertmanager's gossip port: loopback only, unused
        self.procs.append(
            subprocess.Popen(
                [
                    am,
                    f"--config.file={work / 'alertmanager.yml'}",
                    f"--storage.path={work / 'am'}",
                    f"--web.listen-address={am_addr}",
                    f"--cluster.listen-address=127.0.0.1:{cluster_port}",
                ],
                stdout=open(work / "alertmanager.log", "wb"),  # noqa: SIM115 - lives with the process
                stderr=subprocess.STDOUT,
            )
        )
        self.procs.append(
            subprocess.Popen(
                [
                    prom,
                    f"--config.file={work / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.prometheus_port}",
                ],
                stdout=open(work / "prometheus.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
        )
        deadline = time.monotonic() + timeout_s
        for url in (f"{self.alertmanager_url}/-/ready", f"{self.prometheus_url}/-/ready"):
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                        self.stop()
                        raise RuntimeError(f"{url} did not come up; logs in {work}") from None
                    time.sleep(0.2)
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()

    # ----- reading -------------------------------------------------------------------------

    def query(self, promql: str) -> list[dict]:
        """Instant query; the ``result`` vector."""
        q = urllib.parse.urlencode({"query": promql})
        return _get_json(f"{self.prometheus_url}/api/v1/query?{q}")["data"]["result"]

    def targets_up(self) -> bool:
        active = _get_json(f"{self.prometheus_url}/api/v1/targets")["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def alerts(self, name: str | None = None, active: bool = True) -> list[dict]:
        """Alertmanager's alerts (v2 API), optionally only those named ``name``."""
        params = {"active": str(active).lower(), "silenced": "false", "inhibited": "false"}
        if name:
            params["filter"] = f'alertname="{name}"'
        q = urllib.parse.urlencode(params)
        return _get_json(f"{self.alertmanager_url}/api/v2/alerts?{q}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m monitoring.stack", description=__doc__)
    parser.add_argument("--monitor", default=MONITOR_PLACEHOLDER, help="monitor host:port")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape/evaluation seconds")
    parser.add_argument("--prometheus-port", type=int, default=9090)
    parser.add_argument("--alertmanager-port", type=int, default=9093)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/specserve-stack"))
    args = parser.parse_args()
    stack = Stack(
        args.monitor,
        args.interval,
        args.workdir,
        args.prometheus_port,
        args.alertmanager_port,
    ).start()
    print(f"Prometheus:   {stack.prometheus_url}   (scraping {args.monitor})")
    print(f"Alertmanager: {stack.alertmanager_url}")
    print(f"Alert rules:  {stack.prometheus_url}/alerts   logs and data: {stack.workdir}")
    print("Ctrl-C stops both.", flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        while not stopping and all(p.poll() is None for p in stack.procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
