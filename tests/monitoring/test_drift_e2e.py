"""The drift monitor end to end, with real components: the demo app on Ray Serve with the
Python-only draft, its monitor deployment, Prometheus and Alertmanager from Debian's
packages on loopback, and an OTLP/HTTP receiver for the OpenTelemetry log records.

Traffic of one domain over HTTP: Python prompts until the detector has learnt its
baseline, then prose (the draft does not know prose: acceptance falls), then Python again.
The drift alert must reach Alertmanager while the detector sees the shifted rounds (how
many seconds that takes is the machine's business: the figures record it), the log record
must have been exported, the length policy must lower k for the domain, and the alert must
resolve once Python traffic is back. Figures go to the test log (-s) and, with the
durations, to ``bench/scratch/drift_e2e.json`` for the closing note.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from ray import serve

from deployments.app import build_specserve_app
from deployments.config import AppConfig
from monitoring.alertmanager import ALERT_NAME, AlertmanagerPush
from monitoring.drift import DriftEvent
from monitoring.stack import Stack, free_port
from tests.conftest import DEMO_TARGET, EAGER, ROOT, wait_for

DOMAIN = "tenant-a"
DRIFT_DRAFT = str(ROOT / "models" / "demo-draft-python")
CONCURRENCY = 2


def prompts(domain: str) -> list[str]:
    rows = (ROOT / "models" / "prompts" / f"{domain}.jsonl").read_text().splitlines()
    return [json.loads(r)["prompt"] for r in rows[:60]]


class OTLPReceiver:
    """Collects OTLP/HTTP protobuf log exports (POST /v1/logs) on a loopback port."""

    def __init__(self):
        self.records: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/logs":
                    req = ExportLogsServiceRequest()
                    req.ParseFromString(body)
                    for rl in req.resource_logs:
                        for sl in rl.scope_logs:
                            receiver.records.extend(sl.log_records)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def drift_records(self) -> list[dict]:
        out = []
        for r in self.records:
            attrs = {a.key: _value(a.value) for a in r.attributes}
            if r.event_name == "specserve.acceptance_drift":
                out.append({"severity": r.severity_text, **attrs})
        return out


def _value(v):
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Traffic:
    """``CONCURRENCY`` clients sending greedy completions of the current domain's prompts."""

    def __init__(self, url: str):
        self.url, self.domain = url, "python"
        self.sent = self.errors = 0
        self.policies: set[str] = set()  # speculation.policy of the responses
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(CONCURRENCY)
        self._futures = [self._pool.submit(self._client, i) for i in range(CONCURRENCY)]

    def _client(self, i: int) -> None:
        texts = {d: prompts(d) for d in ("python", "prose")}
        n = i
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                domain = self.domain
                prompt = texts[domain][n % len(texts[domain])]
                n += CONCURRENCY
                resp = http.post(
                    f"{self.url}/v1/completions",
                    json={
                        "model": "demo-target",
                        "prompt": prompt,
                        "max_tokens": 48,
                        "temperature": 0,
                        "metadata": {"domain": DOMAIN},
                    },
                )
                self.sent += 1
                self.errors += resp.status_code != 200
                if resp.status_code == 200:
                    self.policies.add(resp.json()["speculation"]["policy"])

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=180)
        self._pool.shutdown()


def wait_seeing(monitor, until, what: str, stall_s: float = 150, max_s: float = 900):
    """Wait for ``until()`` as long as the detector keeps seeing rounds of the domain (its
    run's count or statistic moves), up to ``max_s``; fail where it sees none for
    ``stall_s``. The detector needs evidence in rounds, not seconds: with speculation off
    for the domain (the policy's answer to a drift) it sees only the policy's probe
    rounds, one engine round in policy_probe_every, so a slower or busier machine takes
    longer in seconds, not in rounds."""
    deadline, moved = time.monotonic() + max_s, time.monotonic()
    last = None
    while time.monotonic() < deadline:
        if value := until():
            return value
        status = monitor.status.remote().result()["domains"][DOMAIN]
        seen = (status["rounds"], status["statistic"])
        if seen != last:
            last, moved = seen, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise AssertionError(f"waiting for {what}: no round seen for {stall_s:.0f} s: {status}")
        time.sleep(1.0)
    raise AssertionError(f"timed out after {max_s:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def drift_app(serve_http):
    otlp = OTLPReceiver()
    metrics_port = free_port()
    stack = Stack(f"127.0.0.1:{metrics_port}", interval_s=1.0).start()
    cfg = AppConfig.model_validate(
        {
            "engine": {
                "target": {"model": DEMO_TARGET, "num_threads": 1, **EAGER},
                "draft": {"model": DRIFT_DRAFT, "num_threads": 1, **EAGER},
                "engine_resources": {"num_cpus": 0.5},
                "target_resources": {"num_cpus": 1},
                "draft_resources": {"num_cpus": 1},
                "speculation": {
                    "num_speculative_tokens": 4,
                    "policy": "goodput",
                    # Once the alert fired the domain's speculation goes off and only
                    # probe rounds bring evidence of its recovery: the shortest period
                    # allowed, so that the resolve needs the fewest rounds in all.
                    "policy_probe_every": 8,
                    # The gate keeps drafting at 2+ sequences only where it measures 10 %
                    # faster: on a loaded host it closed, no round drafted, and the detector
                    # never learnt its baseline (CI). This test is about k per domain.
                    "policy_gate": False,
                },
                "scheduler": {"max_num_seqs": 8},
            },
            "num_replicas": 1,
            "monitoring": {
                "prometheus_port": metrics_port,
                "prometheus_host": "127.0.0.1",
                "flush_interval_s": 0.5,
                "otlp_endpoint": otlp.url,
                "domain_source": "metadata",
                # A short warm-up keeps the test short; the detector's defaults are for
                # production traffic (see DriftConfig). Costs: models/README.md.
                # The resolve test's own threshold, lower than the fire test's (ln 2000
                # against ln 2e5 nats): once the alert fired the domain speculates little
                # (probe rounds), and the default took over 400 s to resolve on a slow host.
                "drift": {
                    "warmup_tokens": 1500,
                    "cost_ratio": 0.12,
                    "verify_ratio": 1.35,
                    "resolve_arl_rounds": 2000,
                },
            },
        }
    )
    serve.run(build_specserve_app(config=cfg, name="Drift"), name="Drift", route_prefix="/drift")
    monitor = serve.get_deployment_handle("DriftMonitor", "Drift")
    yield f"{serve_http}/drift", stack, otlp, monitor
    serve.delete("Drift")
    stack.stop()
    otlp.server.shutdown()


def domain_state(monitor) -> str | None:
    return monitor.status.remote().result()["domains"].get(DOMAIN, {}).get("state")


def firing(stack: Stack) -> list[dict]:
    return [a for a in stack.alerts(ALERT_NAME) if a["labels"].get("domain") == DOMAIN]


# Its waits end by progress (the detector's rounds), not by the clock: a slow machine needs
# more than the suite's 600 s per test; a stalled detector still fails it in 150 s.
@pytest.mark.timeout(1800)
def test_drift_alert_fires_in_alertmanager_lowers_k_and_resolves(drift_app):
    url, stack, otlp, monitor = drift_app
    wait_for(stack.targets_up, 60, "Prometheus to scrape the monitor")
    traffic = Traffic(url)
    figures: dict = {}
    try:
        t0 = time.monotonic()
        wait_for(lambda: domain_state(monitor) == "in_control", 300, "the baseline")
        figures["warmup_s"] = round(time.monotonic() - t0, 1)
        status = monitor.status.remote().result()["domains"][DOMAIN]
        figures["baseline"] = status["baseline"]
        figures["dispersion"] = status["dispersion"]
        assert status["dispersion"] >= 1.0, status
        assert not firing(stack), "an alert fired on in-control traffic"

        def k_gauge() -> float | None:
            got = stack.query(f'max(specserve_speculation_k{{domain="{DOMAIN}"}})')
            return float(got[0]["value"][1]) if got else None

        # The policy's k is timing-driven: on a loaded machine one reading can catch a
        # round where no k paid. Wait (bounded) for the in-control domain to speculate.
        wait_for(lambda: (k_gauge() or 0) >= 1, 60, "the policy to speculate in control")
        figures["k_before"] = k_gauge()

        traffic.domain = "prose"  # the shift
        t_shift = time.monotonic()
        alerts = wait_seeing(monitor, lambda: firing(stack), "the drift alert in Alertmanager")
        figures["fire_delay_s"] = round(time.monotonic() - t_shift, 1)  # (for the record)
        fire = next(e for e in monitor.status.remote().result()["events"] if e["kind"] == "fire")
        figures["fire_rounds"] = fire["rounds"]
        figures["alpha_at_fire"] = fire["current"]
        assert alerts[0]["labels"]["severity"] == "warning"

        # The OpenTelemetry log record, exported over OTLP.
        records = wait_for(otlp.drift_records, 30, "the drift log record over OTLP")
        warn = records[0]
        assert warn["severity"] == "WARN" and warn["specserve.domain"] == DOMAIN
        for key in ("baseline", "current", "rounds", "break_even", "k", "dispersion"):
            assert f"specserve.{key}" in warn, warn
        assert warn["specserve.current"] < warn["specserve.baseline"]

        # The length policy reacted: k for the domain fell (or speculation went off).
        assert figures["k_before"] and figures["k_before"] >= 1, figures

        def k_now():
            got = stack.query(f'max(specserve_speculation_k{{domain="{DOMAIN}"}})')
            return got and float(got[0]["value"][1]) < figures["k_before"]

        wait_for(k_now, 30, "the policy to lower k for the domain")
        got = stack.query(f'max(specserve_speculation_k{{domain="{DOMAIN}"}})')
        figures["k_after_fire"] = float(got[0]["value"][1])

        traffic.domain = "python"  # back to what the draft knows
        t_back = time.monotonic()
        wait_seeing(monitor, lambda: not firing(stack), "the alert to resolve")
        figures["resolve_delay_s"] = round(time.monotonic() - t_back, 1)
        kinds = [e["kind"] for e in monitor.status.remote().result()["events"]]
        assert kinds[:2] == ["fire", "resolve"], kinds
        info = wait_for(
            lambda: [r for r in otlp.drift_records() if r["severity"] == "INFO"],
            30,
            "the resolve log record",
        )
        assert info[0]["specserve.domain"] == DOMAIN
    finally:
        traffic.stop()
        figures["requests"], figures["errors"] = traffic.sent, traffic.errors
        print("drift e2e:", json.dumps(figures))
        out = ROOT / "bench" / "scratch"
        out.mkdir(parents=True, exist_ok=True)
        (out / "drift_e2e.json").write_text(json.dumps(figures, indent=2))
    assert traffic.errors == 0
    assert traffic.policies == {"goodput"}  # every request's k came from the policy
    seeded = httpx.post(  # ... except a seeded one's: it runs at the fixed k, and says so
        f"{url}/v1/completions",
        json={"model": "demo-target", "prompt": "def f(x):", "max_tokens": 4, "seed": 3},
        timeout=120,
    )
    assert seeded.status_code == 200 and seeded.json()["speculation"]["policy"] == "fixed"


def test_direct_push_reaches_alertmanager(drift_app):
    """The optional push (monitoring.alertmanager_url) against the real Alertmanager."""
    _url, stack, _otlp, _monitor = drift_app
    push = AlertmanagerPush(stack.alertmanager_url)
    event = DriftEvent("fire", "pushed", 0.8, 0.3, 40, 0.4, 4, 0.55, False)
    assert push(event, "demo-target")
    got = wait_for(
        lambda: [a for a in stack.alerts(ALERT_NAME) if a["labels"]["domain"] == "pushed"],
        10,
        "the pushed alert",
    )
    assert got[0]["labels"]["model"] == "demo-target"
    assert push(DriftEvent("resolve", "pushed", 0.8, 0.75, 40, 0.4, 4, 0.55, False), "demo-target")
    wait_for(
        lambda: not [a for a in stack.alerts(ALERT_NAME) if a["labels"]["domain"] == "pushed"],
        10,
        "the pushed alert to resolve",
    )
    # Unreachable Alertmanager: logged and counted, never raised.
    dead = AlertmanagerPush(f"http://127.0.0.1:{free_port()}", timeout_s=1)
    assert not dead(event, "demo-target") and dead.failed == 1
