"""``python -m bench.adaptation --smoke``: the adaptive demo through a real server, short.

In a process of its own (the benchmark starts its own Ray and Serve, as a user would): the
shipped ``cluster/serve/demo-adaptive.yaml`` with eager models, a fixed k (every round
drafts, whatever the host's load), a short drift warm-up and short runs. Python traffic
until the ``python`` domain's detector is in control, then prose in the same domain, then
Python again, with probes of the drift draft's acceptance on documents the traffic never
contained. What must hold on any machine: every request succeeds and equals transformers
``generate`` of the target; the drift alert fires on the shift; adaptation starts a run for
the domain. (How far and how fast acceptance recovers is the full benchmark's figure, not a
test's.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_adaptive_demo_heals_its_drift_alert_without_a_failed_or_changed_request(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ""}  # its own local cluster, not the tests'
    proc = subprocess.run(
        [sys.executable, "-m", "bench.adaptation", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "adaptation_smoke.json").read_text())
    assert (tmp_path / "adaptation_smoke.png").stat().st_size > 0
    out = payload["results"]
    rows = out["rows"]
    assert out["totals"]["requests"] > 0
    assert out["totals"]["failed"] == 0 and out["totals"]["mismatches"] == 0, out["totals"]
    assert [
        p for p in ("python", "prose", "python-after") if any(r["phase"] == p for r in rows)
    ] == [
        "python",
        "prose",
        "python-after",
    ]
    assert any(r["alert"] == "firing" for r in rows if r["phase"] == "prose"), rows
    assert rows[-1]["outcomes"]["started"] >= 1, rows[-1]
    assert out["pre_alpha"] > out["drifted_alpha"], out
