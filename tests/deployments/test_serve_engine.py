"""The engine as a Ray Serve deployment: placement bundles, handles, streaming, and the
adaptation deployment's retention of finished requests."""

import time

import pytest
from ray import serve

from deployments.app import build_specserve_app
from deployments.config import AppConfig, EngineConfig
from specdec.generate import generate_autoregressive
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from tests.conftest import EAGER


@pytest.fixture(scope="module")
def serve_engine(serve_http, tiny_target, tiny_draft):
    cfg = EngineConfig.model_validate(
        {
            "target": {"model": tiny_target, **EAGER},
            "draft": {"model": tiny_draft, **EAGER},
            "engine_resources": {"num_cpus": 0.5},
            "target_resources": {"num_cpus": 1},
            "draft_resources": {"num_cpus": 1},
        }
    )
    handle = serve.run(
        build_specserve_app(
            config=AppConfig(
                engine=cfg,
                monitoring={"prometheus_port": None},
                adaptation={
                    "retention": {"enabled": True, "domains": ["python"]},
                    # Runs on demand only; a candidate always deploys (the verdict has
                    # tests of its own: tests/adaptation/), trained briefly.
                    "trainer": {
                        "on_drift": False,
                        "steps": 5,
                        "min_gain": -1.0,
                        "max_loss": 1.0,
                        "num_cpus": 0.5,
                    },
                    "poll_interval_s": 0.5,
                },
            ),
            name="engine-test",
        ),
        name="engine-test",
        route_prefix=None,
    )
    yield handle
    serve.delete("engine-test")


def test_workers_live_in_the_replicas_placement_group(serve_engine):
    info = serve_engine.health_info.remote().result()
    assert info["ready"] and info["placement_group_id"]
    assert info["target"]["placement_group_id"] == info["placement_group_id"]
    assert info["draft"]["placement_group_id"] == info["placement_group_id"]


def test_streamed_greedy_output_through_handle_equals_target_only(serve_engine, tiny_target):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = [30, 31, 32, 33, 34]
    expected = generate_autoregressive(ModelRunner(tiny_target), prompt, params).token_ids
    chunks = list(
        serve_engine.options(stream=True).generate.remote(
            {
                "prompt_token_ids": prompt,
                "params": {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True},
            }
        )
    )
    tokens = [t for c in chunks for t in c["new_token_ids"]]
    assert tokens == expected
    assert len(chunks) > 1 and chunks[-1]["finished"] and chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["stats"]["drafted"] > 0


def _finish(handle, prompt: list[int], domain: str, max_tokens: int) -> list[int]:
    """One greedy request through the handle, to its end; its output token ids."""
    request = {
        "prompt_token_ids": prompt,
        "params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        "domain": domain,
    }
    chunks = list(handle.options(stream=True).generate.remote(request))
    assert chunks[-1]["finished"]
    return [t for c in chunks for t in c["new_token_ids"]]


def test_finished_requests_of_allowed_domains_are_retained_and_can_be_dropped(serve_engine):
    """The replica sends each finished request to the adaptation deployment (off the
    request's path); only allowed domains are kept; an operator lists and drops them."""
    store = serve.get_deployment_handle("engine-testAdaptation", "engine-test")
    prompt = [40, 41, 42, 43]
    # Not on the allow list; finished (and sent) first, so it would be there by the time
    # the python request is.
    _finish(serve_engine, [50, 51, 52], "prose", 4)
    output = _finish(serve_engine, prompt, "python", 6)
    deadline = time.monotonic() + 30
    while "python" not in (summary := store.summary.remote().result()):
        assert time.monotonic() < deadline, summary
        time.sleep(0.2)
    assert summary == {
        "python": {"requests": 1, "tokens": 10, "oldest_age_s": summary["python"]["oldest_age_s"]}
    }
    (kept,) = store.records.remote("python").result()
    assert list(kept["prompt_token_ids"]) == prompt and list(kept["output_token_ids"]) == output
    assert store.records.remote("prose").result() == []
    assert store.drop.remote("python").result() == 1
    assert store.summary.remote().result() == {}


def test_an_adaptation_run_reaches_the_replicas_draft_and_output_stays_exact(
    serve_engine, tiny_target
):
    """On demand: a run trains on the retained python requests in a task of its own,
    deploys version 1, the replica loads it into its draft within a few polls, and
    greedy output still equals target-only."""
    store = serve.get_deployment_handle("engine-testAdaptation", "engine-test")
    for i in range(4):
        _finish(serve_engine, [60 + i, 61, 62, 63], "python", 8)
    deadline = time.monotonic() + 30
    while store.summary.remote().result().get("python", {}).get("requests", 0) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    summary = store.adapt.remote("python").result()
    assert summary["outcome"] == "deployed" and summary["version"] == 1, summary
    assert summary["train"]["steps"] == 5 and summary["held_back_requests"] >= 1
    while serve_engine.health_info.remote().result()["draft_version"] != 1:
        assert time.monotonic() < deadline + 60, "the replica never served version 1"
        time.sleep(0.2)
    status = store.status.remote().result()
    assert status["version"] == 1 and status["outcomes"]["deployed"] == 1
    # The monitor learns every domain's baseline anew for the new draft (once per version).
    monitor = serve.get_deployment_handle("engine-testMonitor", "engine-test")
    while monitor.status.remote().result()["draft_version"] != 1:
        assert time.monotonic() < deadline + 90, "the monitor never heard of version 1"
        time.sleep(0.2)
    assert not monitor.new_draft_deployed.remote(1).result()  # a second report: no reset
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = [30, 31, 32, 33, 34]
    expected = generate_autoregressive(ModelRunner(tiny_target), prompt, params).token_ids
    assert _finish(serve_engine, prompt, "default", 20) == expected
