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

# Drafted python rounds a swap is judged on, and that the version before needs for its
# reference (one pass of the rollback test's traffic gives ~50): with 4 against 3, a
# wrecked draft's lucky round or two kept it (CI, d247769).
WINDOW_ROUNDS = 16


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
                    "rollback": {
                        "window_rounds": WINDOW_ROUNDS,
                        "min_before_rounds": WINDOW_ROUNDS,
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


def _finish(handle, prompt: list[int], domain: str, max_tokens: int, k=None) -> list[int]:
    """One greedy request through the handle, to its end; its output token ids (``k``:
    the request's own draft length, else the policy's)."""
    request = {
        "prompt_token_ids": prompt,
        "params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        "domain": domain,
    }
    if k is not None:
        request["num_speculative_tokens"] = k
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
    # Paced by serving's speed (the monitor's, read from the run's own task).
    assert summary["pacing"] is not None and 0.0 < summary["pacing"]["duty"] <= 1.0
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
    # /health names, per domain, the version that drafted its latest round.
    _wait_for(
        "default drafted by version 1",
        lambda: serve_engine.health_info.remote().result()["draft_versions"].get("default") == 1,
    )


def test_an_adapter_run_ships_only_its_factors_to_the_replica(serve_engine, tiny_target):
    """A run with adapters (adapter_min_params below the draft's size): the replica,
    serving the version the run started from, loads the low-rank factors (not the whole
    draft), and greedy output stays the target's."""
    store = serve.get_deployment_handle("engine-testAdaptation", "engine-test")
    for i in range(4):
        _finish(serve_engine, [80 + i, 61, 62, 63], "python", 8)
    _wait_for("retained", lambda: len(store.records.remote("python").result()) >= 4)

    def watched() -> bool:
        # Version 1's live check (the test before) ends on python rounds; a rollback it
        # decided during this run would make the candidate's base stale (CI, 61515ad:
        # "rejected", a newer version served). Python traffic until it has judged.
        if any(v["watch"] == "watching" for v in store.versions.remote().result()):
            _finish(serve_engine, [90, 61, 62, 63], "python", 8, k=3)
            return False
        return True

    _wait_for("version 1 judged", watched, timeout_s=180)
    base = store.served_version.remote().result()
    _wait_for(
        "base served", lambda: serve_engine.health_info.remote().result()["draft_version"] == base
    )
    summary = store.adapt.remote("python", {"adapter_min_params": 1, "lora_rank": 4}).result()
    assert summary["outcome"] == "deployed" and summary["adapters"]["tensors"] > 0, summary
    health = _wait_for(
        "the adapter version served",
        lambda: (
            (h := serve_engine.health_info.remote().result())["draft_version"] == summary["version"]
            and h
        ),
    )
    assert health["draft_update"] == "low_rank"
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = [30, 31, 32, 33, 34]
    expected = generate_autoregressive(ModelRunner(tiny_target), prompt, params).token_ids
    assert _finish(serve_engine, prompt, "default", 20) == expected


def _wait_for(what: str, check, timeout_s: float = 90.0, detail=lambda: ""):
    """Poll ``check`` until it gives something true; ``detail()`` goes into the failure."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: {detail()}"
        time.sleep(0.2)
    return got


def test_a_bad_version_is_rolled_back_by_itself_and_an_operator_controls_versions(
    serve_engine, tiny_target, tmp_path
):
    """A run with a learning rate that wrecks the draft (5.0: the candidate is still
    deployed, the verdict being off in this app) serves version v + 1; its live
    acceptance on python over its first WINDOW_ROUNDS rounds falls far below version v's, so the
    deployment serves version v's weights again as version v + 2, by itself. Then an
    operator lists versions, exports one as a Hugging Face directory, turns adaptation
    off and on, and rolls back by hand. Greedy output equals target-only throughout."""
    from transformers import AutoModelForCausalLM

    store = serve.get_deployment_handle("engine-testAdaptation", "engine-test")
    monitor = serve.get_deployment_handle("engine-testMonitor", "engine-test")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runner = ModelRunner(tiny_target)
    prompts = [[70 + i, 71, 72, 73, 74] for i in range(6)]
    expected = [generate_autoregressive(runner, p, params).token_ids for p in prompts]

    def traffic():  # python rounds for the swap check, each output checked
        for p, e in zip(prompts, expected, strict=True):
            # k fixed: every round drafts (the policy may keep the tiny pair at k = 0)
            assert _finish(serve_engine, p, "python", 16, k=3) == e

    def served(version):
        _wait_for(
            f"version {version} served",
            lambda: serve_engine.health_info.remote().result()["draft_version"] == version,
        )

    traffic()  # (retained, too)
    if store.served_version.remote().result() == 0:  # (run alone: a trained version first)
        _wait_for("retained", lambda: len(store.records.remote("python").result()) >= 4)
        assert store.adapt.remote("python").result()["outcome"] == "deployed"
    # The reference is the draft as deployed (live alpha about 0.5 on these prompts): a
    # trained version may serve worse (0.04 over a window, after the adapter test), and
    # the wrecked version must fall 0.05 below its reference to be rolled back.
    if store.versions.remote().result()[-1]["weights_of"] != 0:
        store.rollback.remote(0, "the test's reference").result()
    # Traffic until the version served has live python rounds and no watch is pending
    # (a version trained with the verdict off may be rolled back itself meanwhile; a
    # rollback to version 0 first loads the checkpoint in a task: a worker to start).
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        v1 = store.served_version.remote().result()
        served(v1)
        traffic()
        pending = [v for v in store.versions.remote().result() if v["watch"] == "watching"]
        counts = monitor.acceptance.remote("python").result()
        if (
            not pending
            and counts.get(v1, (0,))[0] >= WINDOW_ROUNDS
            and v1 == store.served_version.remote().result()
        ):
            break
    else:
        raise AssertionError(f"never settled: {store.versions.remote().result()} {v1} {counts}")
    reference = store.versions.remote().result()[-1]["weights_of"]

    outcomes = store.status.remote().result()["outcomes"]
    bad = store.adapt.remote("python", {"lr": 5.0}).result()
    assert bad["outcome"] == "deployed" and bad["version"] == v1 + 1, bad
    _wait_for(
        "bad served", lambda: serve_engine.health_info.remote().result()["draft_version"] == v1 + 1
    )
    traffic()
    _wait_for(
        "rolled back",
        lambda: store.served_version.remote().result() == v1 + 2,
        detail=lambda: (
            store.versions.remote().result()[-2:],
            monitor.acceptance.remote("python", WINDOW_ROUNDS).result(),
        ),
    )
    versions = store.versions.remote().result()
    wrecked, back = versions[-2], versions[-1]
    assert wrecked["version"] == v1 + 1 and wrecked["watch"].startswith("rolled back: live alpha")
    assert back["origin"] == "rolled_back" and back["weights_of"] == reference
    counts = monitor.acceptance.remote("python", WINDOW_ROUNDS).result()
    alpha = {v: a / max(1, a + r) for v, (_, a, r) in counts.items()}
    assert alpha[v1 + 1] < alpha[v1] - 0.05, counts
    status = store.status.remote().result()
    assert status["outcomes"]["rolled_back"] == outcomes["rolled_back"] + 1
    assert status["outcomes"]["deployed"] == outcomes["deployed"] + 1
    _wait_for(
        "v3 served", lambda: serve_engine.health_info.remote().result()["draft_version"] == v1 + 2
    )
    traffic()

    # An operator: export the served version (the reference's weights) for good.
    out = tmp_path / "draft-export"
    files = store.export.remote(v1 + 2, str(out)).result()
    assert "config.json" in files
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert len(list(exported.parameters())) > 0
    with pytest.raises(Exception, match="not empty"):
        store.export.remote(v1 + 2, str(out)).result()
    # ... turn adaptation off (no run starts, on drift or on demand) and on again
    assert store.set_enabled.remote(False).result() is True
    assert store.on_drift.remote("python").result() is False
    with pytest.raises(Exception, match="turned off"):
        store.adapt.remote("python").result()
    assert store.set_enabled.remote(True).result() is False
    with pytest.raises(Exception, match="lr"):  # a bad setting: refused before any run
        store.adapt.remote("python", {"lr": -1}).result()
    # ... and roll back by hand: to the draft as deployed (its weights loaded afresh),
    # or, where the reference already was those, to any other version kept
    with pytest.raises(Exception, match="already serves"):
        store.rollback.remote(reference).result()
    to = 0 if reference != 0 else wrecked["version"]
    assert store.rollback.remote(to).result() == v1 + 3
    assert store.versions.remote().result()[-1]["weights_of"] == to
    _wait_for(
        "the rollback served",
        lambda: serve_engine.health_info.remote().result()["draft_version"] == v1 + 3,
    )
    traffic()
