"""Prometheus alert rules, Prometheus/Alertmanager configs and the Grafana dashboard.

``promtool`` (Debian's ``prometheus``) and ``amtool`` (``prometheus-alertmanager``) must be
on PATH: ``make test`` installs them (target ``monitoring-tools``). A missing tool fails
these tests instead of skipping them, so the rules are never silently left untested.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "monitoring" / "prometheus"
DASHBOARD = ROOT / "monitoring" / "grafana" / "specserve.json"

# The exporter's Prometheus names (monitoring/README.md): the only ones rules and panels use.
COUNTERS = {
    f"specserve_{name}_total"
    for name in (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_rejection_rounds",
        "spec_decode_num_accepted_tokens_per_pos",
        "spec_decode_num_drafts_per_pos",
        "telemetry_dropped_rounds",
        "speculation_cache_hits",
        "speculation_cache_misses",
        "generation_tokens",
        "adaptation_runs",
        "adaptation_training_tokens",
        "adaptation_training_time_seconds",
    )
}
GAUGES = {
    "specserve_speculation_k",
    "specserve_speculation_enabled",
    "specserve_speculation_break_even_alpha",
    "specserve_acceptance_drift",
    "specserve_acceptance_alpha_baseline",
    "specserve_scheduler_running",
    "specserve_scheduler_waiting",
    "specserve_draft_version",
    "specserve_adaptation_validation_gain",
}
HISTOGRAMS = {
    "specserve_round_verify_seconds",
    "specserve_round_draft_wait_seconds",
    "specserve_round_overhead_seconds",
    "gen_ai_server_time_to_first_token_seconds",
    "gen_ai_server_time_per_output_token_seconds",
    "gen_ai_server_request_duration_seconds",
}
GEN_AI_LABELS = {"gen_ai_operation_name", "gen_ai_request_model", "gen_ai_system"}
KNOWN = (
    COUNTERS
    | GAUGES
    | {h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    | GEN_AI_LABELS
    | {"ALERTS"}
)
NAME = re.compile(r"\b(?:specserve_\w+|gen_ai_\w+|ALERTS)\b")

ALERTS = {
    "SpecServeAcceptanceDrift": ("warning", None),
    "SpecServeAcceptanceBelowBreakEven": ("warning", "5m"),
    "SpecServeSpeculationDisabled": ("info", "15m"),
    "SpecServeHighInterTokenLatency": ("warning", "5m"),
}
TARGET_PLACEHOLDER = "127.0.0.1:9464"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH. `make test` installs it (Debian package `{package}`, "
            f"target `make monitoring-tools`); or: apt-get install -y --no-install-recommends "
            f"{package}",
            pytrace=False,
        )
    return path


def _run(*cmd: str | Path, cwd: Path = PROM) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out}"
    return out


def _unknown_names(expr: str) -> set[str]:
    return set(NAME.findall(expr)) - KNOWN


def _rules() -> list[dict]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    assert [g["name"] for g in groups] == ["specserve"]
    return groups[0]["rules"]


def _dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


# --- promtool / amtool --------------------------------------------------------------------


def test_promtool_check_rules():
    out = _run(_tool("promtool", "prometheus"), "check", "rules", "alerts.yml")
    assert f"SUCCESS: {len(ALERTS)} rules found" in out


def test_promtool_unit_tests():
    """alerts_test.yml: each alert fires where it should and stays silent where it should not."""
    out = _run(_tool("promtool", "prometheus"), "test", "rules", "alerts_test.yml")
    assert "SUCCESS" in out


def test_promtool_check_config():
    out = _run(_tool("promtool", "prometheus"), "check", "config", "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in out
    # The scrape target is the one string a fixture or `make observe` substitutes.
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (scrape,) = config["scrape_configs"]
    assert scrape["static_configs"] == [{"targets": [TARGET_PLACEHOLDER]}]
    assert config["alerting"]["alertmanagers"][0]["static_configs"] == [
        {"targets": ["127.0.0.1:9093"]}
    ]


def test_amtool_check_config():
    _run(_tool("amtool", "prometheus-alertmanager"), "check-config", "alertmanager.yml")


# --- what the rules and their tests contain -----------------------------------------------


def test_alert_set():
    rules = {r["alert"]: r for r in _rules()}
    assert set(rules) == set(ALERTS)
    for name, (severity, for_) in ALERTS.items():
        rule = rules[name]
        assert rule["labels"]["severity"] == severity, name
        assert rule.get("for") == for_, name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert "$labels.model" in rule["annotations"]["summary"], name
        assert not _unknown_names(rule["expr"]), (name, _unknown_names(rule["expr"]))


def test_unit_tests_cover_firing_and_silent_for_each_alert():
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    cases = [case for t in tests for case in t["alert_rule_test"]]
    for name in ALERTS:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no firing case"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no silent case"


# --- Grafana dashboard --------------------------------------------------------------------


def test_dashboard_loads_and_uses_only_known_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert {"model", "domain"} <= set(variables)
    exprs = _dashboard_exprs(dashboard)
    assert exprs
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel.get("targets"), panel["title"]
    for title, expr in exprs:
        assert NAME.search(expr), (title, expr)
        assert not _unknown_names(expr), (title, _unknown_names(expr))
    for name in ("model", "domain"):
        assert not _unknown_names(variables[name]["definition"])
    used = {n for _, e in exprs for n in NAME.findall(e)}
    assert "ALERTS" in used
    assert {
        "specserve_spec_decode_num_accepted_tokens_total",
        "specserve_spec_decode_num_rejection_rounds_total",
        "specserve_spec_decode_num_accepted_tokens_per_pos_total",
        "specserve_spec_decode_num_drafts_per_pos_total",
        "specserve_speculation_k",
        "specserve_speculation_enabled",
        "specserve_generation_tokens_total",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "specserve_round_verify_seconds_sum",
        "specserve_round_draft_wait_seconds_sum",
        "specserve_round_overhead_seconds_sum",
    } <= used


def test_dashboard_promql_parses(tmp_path):
    """Every panel query, with Grafana's variables filled in, is valid PromQL."""
    exprs = _dashboard_exprs(json.loads(DASHBOARD.read_text()))
    fill = {"$__rate_interval": "1m", "$model": ".*", "$domain": ".*"}
    rules = []
    for i, (_, expr) in enumerate(exprs):
        for var, value in fill.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:panel_query:{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = _run(_tool("promtool", "prometheus"), "check", "rules", path, cwd=tmp_path)
    assert f"SUCCESS: {len(rules)} rules found" in out
