"""The engine core compiles its models' graphs (execution_mode torch_compile) as its loop
thread's first work: requests that come meanwhile wait in its queue and are served once
the graphs are ready, with the output of the eager reference. No Ray: the core is a plain
object here, as in ``bench.syncs``."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

from deployments.config import ModelSpec
from deployments.core.engine_core import EngineCore
from deployments.messages import (
    ColocatedDraftConfig,
    EngineCoreConfig,
    EngineCoreOutputs,
    EngineCoreRequest,
    decode,
)
from specdec.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = {"a": [5, 40, 7, 11, 3], "b": [9, 9, 2], "c": list(range(10, 40))}


def core_for(target: str, draft: str, mode: str, cores: list[int] | None = None) -> EngineCore:
    def spec(path: str) -> dict:
        return ModelSpec(
            model=path, num_threads=1, execution_mode=mode, max_model_len=128
        ).model_dump()

    config = EngineCoreConfig(
        spec=spec(target),
        max_num_seqs=4,
        eos_token_ids=[],
        draft_timeout_s=1.0,
        colocated_draft=ColocatedDraftConfig(spec(draft), 0.0, None),
        cpu_affinity=cores,
    )
    return EngineCore(config)


def serve(core: EngineCore) -> dict[str, list[int]]:
    """Every prompt at once, k = 4; each request's tokens once all have finished."""
    core.add_requests(
        [
            EngineCoreRequest(sid, p, [], asdict(GREEDY), 4, "default", False)
            for sid, p in PROMPTS.items()
        ]
    )
    tokens: dict[str, list[int]] = {sid: [] for sid in PROMPTS}
    done, cursor = 0, 0
    deadline = time.monotonic() + 300
    while done < len(PROMPTS) and time.monotonic() < deadline:
        polled = decode(EngineCoreOutputs, core.get_outputs(cursor, 1.0))
        cursor = polled.cursor
        assert polled.error is None
        for out in polled.outputs:
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            done += out.finished
    assert done == len(PROMPTS)
    return tokens


def test_requests_during_warm_up_wait_and_match_eager(tiny_target, tiny_draft):
    core = core_for(tiny_target, tiny_draft, "torch_compile")
    try:
        # Read as soon as the core exists: its loop thread is compiling (seconds of work).
        assert core.health()["warming"] is True
        got = serve(core)
        health = core.health()
    finally:
        core.stop()
    assert health["warming"] is False and health["error"] is None
    assert set(health["compile_seconds"]) == {"target", "draft"}
    graphs = health["compile_seconds"]
    assert len(graphs["target"]) == 4  # its pass shapes
    # the draft's pass shapes, and its fused draft steps (1, 2, 4 for one row; 1, 2 rows)
    assert len(graphs["draft"]) == 4 + 5
    assert sum("draft steps" in name for name in graphs["draft"]) == 5
    assert all(len(t) == GREEDY.max_tokens for t in got.values())
    # (pinned to one core, as a worker's cpu_affinity asks: the same tokens)
    core = sorted(os.sched_getaffinity(0))[-1]
    eager = core_for(tiny_target, tiny_draft, "eager", cores=[core])
    try:
        assert serve(eager) == got
        assert eager.health()["compile_seconds"] == {}
        assert eager.health()["cores"] == [core]
    finally:
        eager.stop()
