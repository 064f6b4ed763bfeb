"""Losing a whole node of the local cluster under load, as a user runs SpecServe: apps
deployed with ``serve deploy``, requests over HTTP, and the node lost with
``cluster/local_cluster.sh stop-node`` (every process of that node SIGKILLed at once, as
when a machine goes away), then brought back with ``start-node``.

- The draft's node (the draft apart from the target, pinned by the ``draft`` resource):
  serving continues target-only with no failed request and unchanged greedy output; when a
  node with the ``draft`` resource returns, the draft is placed on it and rounds carry
  drafts again.
- A replica's node, with two replicas on two nodes: requests in flight on the lost replica
  end promptly with an error a client retries (a 5xx or a broken connection, never a
  hang), Serve sends new requests to the survivor, and the replica is recreated once the
  node is back.

Figures (requests, failures, seconds to recover) are printed (-s) for the closing note.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import DEMO_DRAFT, DEMO_TARGET, EAGER, ROOT, free_port, wait_for
from tests.deployments.test_deploy_shapes import Dashboard, placed_actors, serve_cli

SCRIPT = str(ROOT / "cluster" / "local_cluster.sh")
DEFAULT_NODES = ("target", "draft")  # what `local_cluster.sh start` adds to the head
MAX_TOKENS = 24
CONCURRENCY = 6
# A request that gets no answer within this long is a hang (one takes < 2 s here).
REQUEST_TIMEOUT_S = 90.0
# Statuses an HTTP client (the openai client among them) retries.
RETRYABLE = {500, 502, 503, 504}


def prompts() -> list[str]:
    """Twelve prompts, Python and prose alternating."""
    rows = {
        domain: (ROOT / "models" / "prompts" / f"{domain}.jsonl").read_text().splitlines()[:6]
        for domain in ("python", "prose")
    }
    return [json.loads(r)["prompt"] for pair in zip(*rows.values(), strict=True) for r in pair]


@dataclass
class Outcome:
    prompt: str
    started: float  # time.monotonic() at send
    ended: float
    status: int | None  # None: no HTTP response (the connection broke)
    body: Any  # the JSON of a 200, else the error text


def complete(http: httpx.Client, url: str, prompt: str) -> Outcome:
    payload = {"model": "demo-target", "prompt": prompt, "max_tokens": MAX_TOKENS}
    t0 = time.monotonic()
    try:
        r = http.post(f"{url}/v1/completions", json={**payload, "temperature": 0})
    except httpx.TimeoutException:
        raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S:.0f} s: a hang") from None
    except httpx.TransportError as exc:
        return Outcome(prompt, t0, time.monotonic(), None, repr(exc))
    body = r.json() if r.status_code == 200 else r.text
    return Outcome(prompt, t0, time.monotonic(), r.status_code, body)


def in_flight_at(outcomes: list[Outcome], at: float) -> int:
    """How many requests were sent before ``at`` and ended after it."""
    return sum(o.started < at < o.ended for o in outcomes)


def text(outcome: Outcome) -> str:
    assert outcome.status == 200, (outcome.status, outcome.body)
    return outcome.body["choices"][0]["text"]


def under_load(url: str, work: list[str], after: int, action: Callable[[], None]):
    """``work`` sent by CONCURRENCY clients; ``action`` runs once ``after`` requests have
    ended (the others in flight). Returns (outcomes in order, when the action ran)."""
    done, fired = threading.Semaphore(0), {}

    def trigger() -> None:
        for _ in range(after):
            done.acquire()
        fired["at"] = time.monotonic()
        action()

    def send(http: httpx.Client, prompt: str) -> Outcome:
        try:
            return complete(http, url, prompt)
        finally:
            done.release()

    with (
        httpx.Client(timeout=REQUEST_TIMEOUT_S) as http,
        ThreadPoolExecutor(CONCURRENCY + 1) as pool,
    ):
        trig = pool.submit(trigger)
        outcomes = list(pool.map(lambda p: send(http, p), work))
        trig.result(timeout=120)
    return outcomes, fired["at"]


class LocalCluster:
    """``cluster/local_cluster.sh`` on the test session's cluster."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def __call__(self, *args: str) -> str:
        run = subprocess.run(
            [SCRIPT, *args], env=self.env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr
        return run.stdout

    def nodes(self) -> dict[str, str]:
        """Node name -> up | down."""
        return {line.split()[0]: line.split()[-1] for line in self("nodes").splitlines()}


@pytest.fixture
def app(two_node_cluster, tmp_path):
    """Deploys a SpecServe app on the local cluster with ``serve deploy``; shuts Serve
    down afterwards. Yields ``deploy(name, engine, num_replicas) -> base URL``."""
    _address, env, dashboard_url = two_node_cluster
    dashboard = Dashboard(dashboard_url, env)

    def deploy(name: str, engine: dict[str, Any], num_replicas: int = 1) -> str:
        port = free_port()
        args = {
            "engine": engine,
            "num_replicas": num_replicas,
            "monitoring": {"prometheus_port": free_port()},
        }
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [
                {
                    "name": name,
                    "route_prefix": "/",
                    "import_path": "deployments.app:build_app",
                    "args": args,
                }
            ],
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        serve_cli(env, "deploy", str(path), "-a", dashboard_url, check=True)
        dashboard.wait_running(name, timeout_s=300)
        return f"http://127.0.0.1:{port}"

    cluster = LocalCluster(env)
    yield deploy, dashboard, cluster
    serve_cli(env, "shutdown", "-y", "-a", dashboard_url, check=False)
    # The cluster as the next test expects it: the default nodes up, nodes added here gone.
    for name, state in cluster.nodes().items():
        if name in DEFAULT_NODES and state == "down":
            cluster("start-node", name)
        elif name not in DEFAULT_NODES and state == "up":
            cluster("stop-node", name)


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/health", timeout=30).json()


def target_only(url: str) -> dict[str, Any] | None:
    state = health(url)
    return state if state["draft"] is False else None


def test_losing_the_drafts_node_serves_target_only_until_a_draft_node_returns(app):
    deploy, dashboard, cluster = app
    model = {"num_threads": 1, **EAGER}
    engine = {
        "target": {"model": DEMO_TARGET, **model},
        "draft": {"model": DEMO_DRAFT, **model},
        "engine_resources": {"num_cpus": 0.5},
        "target_resources": {"num_cpus": 1, "resources": {"target": 1}},
        # all the draft node's CPU: nothing else of the replica can land there
        "draft_resources": {"num_cpus": 1, "resources": {"draft": 1}},
        "placement_strategy": "PACK",
        "speculation": {"num_speculative_tokens": 4, "policy": "fixed"},
        "scheduler": {"max_num_seqs": 8},
    }
    url = deploy("draftloss", engine)
    before = placed_actors(dashboard, "draftloss")
    assert "draft" in before["draft"]["node_resources"]
    assert before["draft"]["node_id"] != before["target"]["node_id"]
    work = prompts()
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        reference = {p: complete(http, url, p) for p in work}
    assert all(o.body["speculation"]["drafted"] > 0 for o in reference.values())
    figures: dict[str, Any] = {}
    try:
        outcomes, lost_at = under_load(url, work * 3, 12, lambda: cluster("stop-node", "draft"))
        figures["requests"] = len(outcomes)
        figures["in_flight_at_loss"] = in_flight_at(outcomes, lost_at)
        figures["failed"] = sum(o.status != 200 for o in outcomes)
        figures["differ"] = sum(text(o) != text(reference[o.prompt]) for o in outcomes)
        assert figures["in_flight_at_loss"] > 0, figures
        assert figures["failed"] == 0 and figures["differ"] == 0, figures
        state = wait_for(lambda: target_only(url), 60, "the replica to serve target-only")
        assert state["status"] == "degraded", state
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:  # target-only, still exact
            alone = complete(http, url, work[0])
        assert alone.body["speculation"]["drafted"] == 0
        assert text(alone) == text(reference[work[0]])

        back_at = time.monotonic()
        cluster("start-node", "draft")
        wait_for(lambda: health(url)["draft"], 300, "the draft to be placed again")
        figures["draft_back_s"] = round(time.monotonic() - back_at, 1)
        after = placed_actors(dashboard, "draftloss")
        assert "draft" in after["draft"]["node_resources"]
        assert after["draft"]["node_id"] not in (
            before["draft"]["node_id"],
            after["target"]["node_id"],
        )
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            again = [complete(http, url, p) for p in work[:4]]
        assert all(o.body["speculation"]["drafted"] > 0 for o in again)
        assert [text(o) for o in again] == [text(reference[p]) for p in work[:4]]
    finally:
        print("draft node loss:", json.dumps(figures))


def alive_replicas(dashboard: Dashboard) -> list[dict[str, Any]]:
    cls = "ServeReplica:replicaloss:SpecServe"
    return dashboard.state("actors", state="ALIVE", class_name=cls)


def test_losing_a_replicas_node_fails_its_requests_retryably_and_the_replica_returns(app):
    deploy, dashboard, cluster = app
    # Two nodes that hold one replica each (the replica_slot resource), nothing else.
    for name in ("replica-a", "replica-b"):
        state = cluster.nodes().get(name)
        if state is None:
            cluster("add-node", name, "2", "replica_slot=1")
        elif state == "down":  # (added by an earlier run in this session)
            cluster("start-node", name)
    engine = {
        "target": {"model": DEMO_TARGET, "num_threads": 1, **EAGER},
        "engine_resources": {"num_cpus": 0.5, "resources": {"replica_slot": 1}},
        "target_resources": {"num_cpus": 1},
        "placement_strategy": "STRICT_PACK",
        "scheduler": {"max_num_seqs": 8},
    }
    url = deploy("replicaloss", engine, num_replicas=2)
    before = alive_replicas(dashboard)
    assert len({a["node_id"] for a in before}) == 2
    work = prompts()
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        reference = {p: text(complete(http, url, p)) for p in work}
    figures: dict[str, Any] = {}
    try:
        outcomes, lost_at = under_load(url, work * 4, 12, lambda: cluster("stop-node", "replica-b"))
        failed = [o for o in outcomes if o.status != 200]
        figures["requests"], figures["failed"] = len(outcomes), len(failed)
        figures["failed_statuses"] = sorted({str(o.status) for o in failed})
        figures["slowest_failure_s"] = round(max((o.ended - lost_at for o in failed), default=0), 1)
        # Requests were in flight at the loss (6 clients, 2 replicas). Those of the lost
        # replica fail in a way a client retries, promptly; or Serve finished them (a
        # clean run at 272d0d4: 48 of 48 answered 200, the proxy having logged the lost
        # actor for 3 of them), in which case their text is checked as any other's below.
        figures["in_flight_at_loss"] = in_flight_at(outcomes, lost_at)
        assert figures["in_flight_at_loss"] > 0, figures
        for o in failed:
            assert o.status is None or o.status in RETRYABLE, (o.status, o.body)
            assert o.ended - lost_at < 30, (o.ended - lost_at, o.body)
        # Requests sent once the failures were over went to the survivor.
        settled = max((o.ended for o in failed), default=lost_at)
        later = [o for o in outcomes if o.started > settled]
        figures["sent_after_failures"] = len(later)
        assert later and all(o.status == 200 for o in later), figures
        assert all(text(o) == reference[o.prompt] for o in outcomes if o.status == 200)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:  # the client's retry
            assert all(text(complete(http, url, o.prompt)) == reference[o.prompt] for o in failed)

        back_at = time.monotonic()
        cluster("start-node", "replica-b")

        def two_running() -> bool:
            app_state = dashboard.app_status("replicaloss")
            replicas = app_state["deployments"]["SpecServe"]["replicas"]
            running = [r for r in replicas if r["state"] == "RUNNING"]
            return len(running) == 2 and app_state["status"] == "RUNNING"

        wait_for(two_running, 300, "the lost replica to be recreated")
        figures["replica_back_s"] = round(time.monotonic() - back_at, 1)
        after = alive_replicas(dashboard)
        assert len({a["node_id"] for a in after}) == 2
        # a new replica actor, not the old one still listed
        assert {a["actor_id"] for a in after} - {a["actor_id"] for a in before}
    finally:
        print("replica node loss:", json.dumps(figures))
