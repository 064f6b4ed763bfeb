"""The monitor with the real OpenTelemetry SDK: metrics, drift log records, Prometheus."""

import socket

import httpx
import numpy as np
import pytest
from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from deployments.frontend.telemetry_link import rank_records
from monitoring.drift import DriftConfig, DriftState
from monitoring.monitor import ADAPTATION_EVENT, DRIFT_EVENT, Monitor, build_providers
from monitoring.records import (
    AdaptationRecord,
    AlertCursor,
    AlertRecord,
    ReportReply,
    RequestRecord,
    RoundBatch,
    RoundRecord,
)
from specdec.speedup import break_even_alpha, expected_tokens_per_round

K = 4
FAST = DriftConfig(warmup_tokens=3000)


def rounds(rng, domain, alpha, n):
    """n rounds of k drafts with i.i.d. per-token acceptance alpha (censored geometric)."""
    out = []
    for _ in range(n):
        a = 0
        while a < K and rng.random() < alpha:
            a += 1
        out.append(RoundRecord(domain, K, a, cache_hit=bool(rng.random() < 0.5)))
    return out


def batch(records, **kw):
    return RoundBatch(model="demo-target", replica="r1", rounds=records, **kw)


@pytest.fixture
def monitor():
    reader, logs = InMemoryMetricReader(), InMemoryLogRecordExporter()
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
    mon = Monitor(MeterProvider(metric_readers=[reader]), logger_provider, FAST)
    yield mon, reader, logs
    mon.shutdown()


def points(reader, name):
    """{frozenset(attributes): value} of one metric in the reader's current data."""
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    for p in m.data.data_points:
                        out[frozenset(p.attributes.items())] = getattr(p, "value", p)
    return out


def test_counters_give_the_k_free_acceptance_estimate(monitor):
    mon, reader, _ = monitor
    rng = np.random.default_rng(0)
    recs = rounds(rng, "python", 0.8, 2000)
    mon.report(
        batch(
            recs,
            verify_s=[0.01] * 5,
            running=3,
            waiting=1,
            committed={"python": 77},
            kv_cache_usage=0.75,
            kv_cache_token_usage=0.25,
        )
    )
    key = frozenset(
        {
            "model": "demo-target",
            "replica": "r1",
            "domain": "python",
            "proposer": "draft_model",
        }.items()
    )
    accepted = points(reader, "specserve.spec_decode.num_accepted_tokens")[key]
    rejections = points(reader, "specserve.spec_decode.num_rejection_rounds")[key]
    assert points(reader, "specserve.spec_decode.num_drafts")[key] == 2000
    assert accepted == sum(r.accepted for r in recs)
    assert rejections == sum(r.accepted < r.drafted for r in recs)
    assert accepted / (accepted + rejections) == pytest.approx(0.8, abs=0.02)
    per_pos = points(reader, "specserve.spec_decode.num_accepted_tokens_per_pos")
    by_pos = [per_pos[frozenset({**dict(key), "position": p}.items())] for p in range(K)]
    assert by_pos == [sum(r.accepted > p for r in recs) for p in range(K)]
    per_domain = frozenset((k, v) for k, v in key if k != "proposer")  # (not by proposer)
    assert points(reader, "specserve.generation.tokens")[per_domain] == 77
    base = frozenset({"model": "demo-target", "replica": "r1"}.items())
    assert points(reader, "specserve.scheduler.running")[base] == 3
    assert points(reader, "specserve.kv_cache.usage")[base] == 0.75
    assert points(reader, "specserve.kv_cache.token_usage")[base] == 0.25
    hits = points(reader, "specserve.speculation.cache_hits")[base]
    misses = points(reader, "specserve.speculation.cache_misses")[base]
    assert hits + misses == 2000
    assert points(reader, "specserve.round.verify")[base].count == 5


def test_drift_fires_and_resolves_with_log_records_and_a_gauge(monitor):
    """Python traffic drops from 0.75 to 0.45 per-token acceptance: the alert fires (within
    100 rounds here; the detection-delay figures are measured in test_drift) with a WARN
    record; prose next to it never alerts; back to 0.75, it resolves with an INFO record
    and the gauge returns to 0."""
    mon, reader, logs = monitor
    rng = np.random.default_rng(1)
    for _ in range(40):  # warm-up and in control, both domains, 100 rounds per flush
        mon.report(batch(rounds(rng, "python", 0.75, 50) + rounds(rng, "prose", 0.75, 50)))
    assert mon.events == []
    delay = None
    for i in range(100):
        mon.report(batch(rounds(rng, "python", 0.45, 1) + rounds(rng, "prose", 0.75, 1)))
        if mon.events:
            delay = i + 1
            break
    assert delay is not None, delay
    (fired,) = mon.events
    assert fired.kind == "fire" and fired.domain == "python" and fired.k == K
    # A replica new to the monitor while it fires learns of the firing alert.
    assert mon.alerts_since(None) == ReportReply(
        [AlertRecord("python", fired.current)], AlertCursor(mon.epoch, 1)
    )
    gauge = points(reader, "specserve.acceptance_drift")
    assert gauge[frozenset({"model": "demo-target", "domain": "python"}.items())] == 1
    for _ in range(60):
        if len(mon.events) > 1:
            break
        mon.report(batch(rounds(rng, "python", 0.75, 20) + rounds(rng, "prose", 0.75, 20)))
    assert [e.kind for e in mon.events] == ["fire", "resolve"]
    assert gauge_value(reader, "python") == 0
    assert mon.alerts_since(None).alerts == []  # resolved: nothing firing for new replicas
    records = [r.log_record for r in logs.get_finished_logs()]
    assert [r.event_name for r in records] == [DRIFT_EVENT, DRIFT_EVENT]
    assert [r.severity_number for r in records] == [SeverityNumber.WARN, SeverityNumber.INFO]
    attrs = records[0].attributes
    assert attrs["specserve.domain"] == "python" and attrs["specserve.k"] == K
    assert attrs["specserve.baseline"] == pytest.approx(0.75, abs=0.03)
    assert attrs["specserve.current"] < 0.6
    assert {"specserve.rounds", "specserve.break_even"} <= set(attrs)
    assert attrs["specserve.dispersion"] >= 1.0  # the variance inflation it divided by
    # What replicas learn: each alert change once, in order, with the latest estimate.
    start = AlertCursor(mon.epoch, 0)  # a replica that flushed before the alert
    reply = mon.alerts_since(start)
    alerts, cursor = reply.alerts, reply.cursor
    assert [a.domain for a in alerts] == ["python", "python"]
    assert cursor == AlertCursor(mon.epoch, 2)
    assert alerts[0].current_alpha == pytest.approx(mon.events[0].current)
    assert mon.alerts_since(cursor) == ReportReply([], cursor)
    # A replica from before monitoring/records.py sends its cursor as a tuple.
    assert mon.alerts_since((mon.epoch, 0)) == reply
    # A new replica, or one whose cursor is from a monitor since restarted: no history,
    # only what fires now (nothing: the alert resolved).
    assert mon.alerts_since(None) == ReportReply([], cursor)
    assert mon.alerts_since(AlertCursor("an-old-monitor", 1)) == ReportReply([], cursor)


def test_acceptance_by_position_counts_only_rounds_that_reached_it(monitor):
    """With k varying per round (the length policy), position p's acceptance is accepted
    at p over rounds that drafted past p: a round of k = 1 is no rejection at position 3.
    Every round here accepts all its drafts, so every position must read exactly 1."""
    mon, reader, _ = monitor
    recs = [RoundRecord("code", k, k) for k in (1, 1, 2, 4, 4, 3, 1)]
    mon.report(batch(recs, dropped=5))
    key = {"model": "demo-target", "replica": "r1", "domain": "code", "proposer": "draft_model"}
    acc = points(reader, "specserve.spec_decode.num_accepted_tokens_per_pos")
    reached = points(reader, "specserve.spec_decode.num_drafts_per_pos")
    for p in range(4):
        at = frozenset({**key, "position": p}.items())
        assert reached[at] == sum(r.drafted > p for r in recs)
        assert acc[at] / reached[at] == 1.0
    base = frozenset({"model": "demo-target", "replica": "r1"}.items())
    assert points(reader, "specserve.telemetry.dropped_rounds")[base] == 5


def test_break_even_comes_from_measured_round_times(monitor):
    """A replica's policy reports T(k) / T(0): the break-even gauge and the detector's
    break-even solve E(alpha, k) = T(k) / T(0), not the configured cost ratios."""
    mon, reader, _ = monitor
    rng = np.random.default_rng(3)
    for _ in range(20):  # the domain is in control at k = K
        mon.report(batch(rounds(rng, "code", 0.8, 100)))
    ratios = {1: 1.2, 2: 1.5, K: 2.0}
    mon.report(batch([], policy={"code": {"k": K, "alpha": 0.8, "round_time_ratio": ratios}}))
    key = frozenset({"model": "demo-target", "replica": "r1", "domain": "code"}.items())
    gauge = points(reader, "specserve.speculation.break_even_alpha")[key]
    assert gauge == pytest.approx(break_even_alpha(K, 0.0, 2.0))
    assert expected_tokens_per_round(gauge, K) == pytest.approx(2.0, rel=1e-6)
    status = mon.detector.status("code")
    assert status.state is DriftState.IN_CONTROL
    assert status.k == K and status.break_even == pytest.approx(gauge, abs=1e-3)
    # Another replica at another batch size: the detector takes the mean per k.
    other = RoundBatch(
        model="demo-target",
        replica="r2",
        policy={"code": {"k": K, "alpha": 0.8, "round_time_ratio": {K: 3.0}}},
    )
    mon.report(other)
    assert mon.detector.status("code").break_even == pytest.approx(
        break_even_alpha(K, 0.0, 2.5), abs=1e-3
    )
    # A k without a measurement falls back to the configured costs.
    mon.report(batch([], policy={"code": {"k": 3, "alpha": 0.8, "round_time_ratio": ratios}}))
    cfg = mon.detector.config
    fallback = break_even_alpha(3, cfg.cost_ratio, cfg.verify_ratio)
    assert points(reader, "specserve.speculation.break_even_alpha")[key] == fallback


def test_policy_choices_become_gauges(monitor):
    mon, reader, _ = monitor
    mon.report(batch([], policy={"python": {"k": 3, "alpha": 0.8}, "prose": {"k": 0}}))
    k = points(reader, "specserve.speculation.k")
    on = points(reader, "specserve.speculation.enabled")
    key = frozenset({"model": "demo-target", "replica": "r1", "domain": "prose"}.items())
    assert k[key] == 0 and on[key] == 0
    key = frozenset({"model": "demo-target", "replica": "r1", "domain": "python"}.items())
    assert k[key] == 3 and on[key] == 1


def test_core_telemetry_is_bounded_and_drains():
    from deployments.core.round_stats import Telemetry
    from specdec.stats import RoundStats, RowOutcome

    t = Telemetry(max_rounds=5)
    for i in range(4):
        rows = [RowOutcome("d", 4, i % 5, False, 2, True), RowOutcome("e", 4, 4, True, 5, True)]
        t.add(RoundStats(2, 4, False, total_s=0.012, verify_s=0.01, rows=rows))
    out = t.drain()
    assert len(out["rounds"]) == 5 and out["dropped"] == 3
    assert out["committed"] == {"d": 8, "e": 20}
    assert out["overhead_s"] == [pytest.approx(0.002)] * 4
    assert t.drain()["rounds"] == []


def gauge_value(reader, domain):
    return points(reader, "specserve.acceptance_drift")[
        frozenset({"model": "demo-target", "domain": domain}.items())
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_endpoint_names_and_bounded_cardinality():
    port = free_port()
    meter_provider, logger_provider, _ = build_providers(port, cardinality_limit=8)
    mon = Monitor(meter_provider, logger_provider, FAST)
    try:
        rng = np.random.default_rng(2)
        recs = [r for d in range(30) for r in rounds(rng, f"tenant-{d}", 0.7, 3)]
        mon.report(batch(recs))
        mon.report_request(RequestRecord("demo-target", "r1", "tenant-0", "chat", 0.05, 0.5, 10))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        mon.shutdown()
    for name in (
        "specserve_spec_decode_num_drafts_total",
        "specserve_spec_decode_num_rejection_rounds_total",
        "specserve_spec_decode_num_accepted_tokens_per_pos_total",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "gen_ai_server_request_duration_seconds_count",
    ):
        assert name in text, name
    drafts = [
        line
        for line in text.splitlines()
        if line.startswith("specserve_spec_decode_num_drafts_total{")
    ]
    # 30 domains, at most 8 series plus the overflow series that holds the rest.
    assert len(drafts) <= 8 + 1 and any('otel_metric_overflow="true"' in line for line in drafts)
    assert 'gen_ai_operation_name="chat"' in text


def test_an_acknowledged_alert_is_not_sent_to_new_replicas(monitor):
    """Acknowledging ends an alert without a resolve: replicas that join later must not
    be told the old, low acceptance (it would switch their speculation off)."""
    mon, _, _ = monitor
    rng = np.random.default_rng(4)
    for _ in range(20):
        mon.report(batch(rounds(rng, "python", 0.8, 100)))
    for _ in range(50):
        if mon.events:
            break
        mon.report(batch(rounds(rng, "python", 0.3, 20)))
    assert [e.kind for e in mon.events] == ["fire"]
    assert [a.domain for a in mon.alerts_since(None).alerts] == ["python"]
    mon.acknowledge("python")
    assert mon.alerts_since(None).alerts == []


def test_draft_versions_and_adaptation_outcomes_are_metrics_and_log_records(monitor):
    """Each replica's served version is a gauge; rounds are counted per (domain, version)
    for the swap check; each adaptation outcome is counted, with a log record (WARN for a
    rollback)."""
    mon, reader, logs = monitor
    rng = np.random.default_rng(3)
    old = rounds(rng, "prose", 0.2, 50)
    new = [
        RoundRecord(r.domain, r.drafted, r.accepted, draft_version=1)
        for r in rounds(rng, "prose", 0.8, 50)
    ]
    mon.report(batch(old + new, draft_version=1))
    mon.report(RoundBatch(model="demo-target", replica="r2", rounds=[]))  # not swapped yet
    versions = points(reader, "specserve.draft_version")
    assert versions == {
        frozenset({"model": "demo-target", "replica": "r1"}.items()): 1,
        frozenset({"model": "demo-target", "replica": "r2"}.items()): 0,
    }
    counts = mon.versions.counts("prose")
    assert counts[0][0] == counts[1][0] == 50
    alpha = {v: a / (a + r) for v, (_, a, r) in counts.items()}
    assert alpha[0] < 0.35 < 0.65 < alpha[1]

    mon.report_adaptation(AdaptationRecord("demo-target", "started", "prose", 0))
    mon.report_adaptation(
        AdaptationRecord("demo-target", "deployed", "prose", 1, "gained", 0.6, 5000, 12.5)
    )
    mon.report_adaptation(AdaptationRecord("demo-target", "rolled_back", "prose", 2, "fell"))
    runs = points(reader, "specserve.adaptation.runs")
    by_outcome = {dict(k)["outcome"]: v for k, v in runs.items()}
    assert by_outcome == {"started": 1, "deployed": 1, "rolled_back": 1}
    assert list(points(reader, "specserve.adaptation.validation_gain").values()) == [0.6]
    assert list(points(reader, "specserve.adaptation.training_tokens").values()) == [5000]
    assert list(points(reader, "specserve.adaptation.training_time").values()) == [12.5]
    records = [r.log_record for r in logs.get_finished_logs()]
    assert [r.event_name for r in records] == [ADAPTATION_EVENT] * 3
    assert [r.severity_number for r in records][-1] == SeverityNumber.WARN
    assert records[1].attributes["specserve.outcome"] == "deployed"
    assert records[1].attributes["specserve.version"] == 1


def test_a_firing_alert_says_when_the_drift_began():
    """The change point is the last report after which the domain's CUSUM stood at 0:
    reports before the drop, none after it (its evidence builds from the drop on)."""
    now = [0.0]
    mon = Monitor(MeterProvider(), LoggerProvider(), FAST, clock=lambda: now[0])
    rng = np.random.default_rng(7)
    t_drop, fired_at = None, None
    for t in range(400):
        now[0] = float(t)
        alpha = 0.8 if t < 200 else 0.1
        if t == 200:
            t_drop = now[0]
        events = mon.report(batch(rounds(rng, "python", alpha, 10)))
        if any(e.kind == "fire" for e in events):
            fired_at = now[0]
            break
    assert fired_at is not None and fired_at > t_drop
    since = mon.drift_since("python")
    assert t_drop - 5 <= since < t_drop + 1, (since, t_drop, fired_at)
    assert mon.drift_since("prose") is None
    mon.shutdown()


def test_ngram_rounds_are_counted_by_proposer_but_never_drift(monitor):
    """Rounds drafted by n-gram lookup reach the counters under ``proposer="ngram"``;
    the drift detector and the per-version counts hear the draft model's alone, so a
    domain whose lookups all fail does not look like a drifted draft."""
    mon, reader, _ = monitor
    rng = np.random.default_rng(3)
    mon.report(batch(rounds(rng, "code", 0.8, 1500)))  # the draft model's baseline
    failing = [RoundRecord("code", K, 0, proposer="ngram") for _ in range(1500)]
    assert mon.report(batch(failing)) == []
    assert mon.detector.status("code").state != DriftState.FIRING
    drafted = points(reader, "specserve.spec_decode.num_draft_tokens")
    by_proposer = {dict(k)["proposer"]: v for k, v in drafted.items()}
    assert by_proposer == {"draft_model": 1500 * K, "ngram": 1500 * K}
    assert sum(r for r, _, _ in mon.versions.counts("code").values()) == 1500


def test_serving_speed_is_output_tokens_per_second_of_request_time_over_a_window():
    now = [1000.0]
    mon = Monitor(MeterProvider(), LoggerProvider(), FAST, clock=lambda: now[0])
    assert mon.serving_speed(5.0) is None  # nothing served

    def finished(tokens, seconds, error=None):
        mon.report_request(
            RequestRecord("demo-target", "r1", "a", "text_completion", 0.1, seconds, tokens, error)
        )

    finished(40, 0.5)
    finished(20, 0.5)
    finished(30, 9.0, error="cancelled")  # a failed or abandoned request says nothing
    now[0] += 3.0
    finished(60, 1.0)
    assert mon.serving_speed(5.0) == pytest.approx(120 / 2.0)
    assert mon.serving_speed(2.0) == pytest.approx(60 / 1.0)  # the newest request alone
    now[0] += 10.0
    assert mon.serving_speed(5.0) is None  # idle since: no evidence, not a slowdown
    mon.shutdown()


def test_the_proposer_choice_becomes_gauges(monitor):
    mon, reader, _ = monitor
    choice = {"1": {"method": "ngram", "goodput": {"draft_model": 40.0, "ngram": 55.0}}}
    mon.report(batch([], policy={"code": {"proposers": choice}}))
    in_use = points(reader, "specserve.speculation.proposer_in_use")
    goodput = points(reader, "specserve.speculation.proposer_goodput")
    key = {"model": "demo-target", "replica": "r1", "domain": "code", "bucket": "1"}
    assert in_use[frozenset({**key, "proposer": "ngram"}.items())] == 1
    assert in_use[frozenset({**key, "proposer": "draft_model"}.items())] == 0
    assert goodput[frozenset({**key, "proposer": "ngram"}.items())] == 55.0


def test_a_split_targets_ranks_become_gauges(monitor):
    """/health's tensor_parallel, as the replica's telemetry link sends it: each rank up or
    not, and the calls it has run (a dead rank's last count is not reported as current)."""
    mon, reader, _ = monitor
    group = {
        "size": 3,
        "calls": 120,
        "ranks": [
            {"rank": 1, "pid": 4242, "calls": 118},
            {"rank": 2, "error": "GetTimeoutError('hung')"},
        ],
    }
    assert rank_records(None) == ()  # a whole target has no ranks
    mon.report(batch([], ranks=rank_records(group)))
    up = points(reader, "specserve.tensor_parallel.rank_up")
    calls = points(reader, "specserve.tensor_parallel.rank_calls")
    assert {dict(k)["rank"]: v for k, v in up.items()} == {0: 1, 1: 1, 2: 0}
    assert {dict(k)["rank"]: v for k, v in calls.items()} == {0: 120, 1: 118}
    assert all(dict(k)["replica"] == "r1" for k in up)
