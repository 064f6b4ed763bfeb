"""On a two-node local cluster, draft and target land on different nodes and generate."""

import json
import subprocess
import sys
from pathlib import Path

from specdec.generate import generate_autoregressive
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_draft_and_target_on_different_nodes(two_node_cluster, tiny_target, tiny_draft):
    address, env, _dashboard = two_node_cluster
    job = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("two_node_job.py")),
            address,
            tiny_target,
            tiny_draft,
        ],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    # Its result is its last JSON line: Ray may print warnings after it (a raylet's lagging
    # heartbeats on a loaded host).
    result = json.loads(next(x for x in reversed(job.stdout.splitlines()) if x.startswith("{")))
    assert result["target_node"] != result["draft_node"]
    assert "target" in result["target_node_resources"]
    assert "draft" in result["draft_node_resources"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = generate_autoregressive(ModelRunner(tiny_target), [30, 31, 32, 33, 34], params)
    assert result["tokens"] == expected.token_ids
    assert result["drafted"] > 0
