"""Config validation and placement bundles: pure, no cluster."""

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig, EngineConfig, WorkerResources
from deployments.placement import bundle, placement_for
from tests.conftest import COMPILE_CACHE_DIR


def cfg(**kw):
    base = {"target": {"model": "t"}, "draft": {"model": "d"}}
    base.update(kw)
    return EngineConfig.model_validate(base)


def test_defaults_and_model_name():
    c = cfg(target={"model": "org/big-8b/"})
    assert c.speculation.mode == "overlap"
    assert c.model_name == "big-8b"
    assert cfg(served_model_name="x").model_name == "x"
    # (in-process test runners share the workers' compile cache: tests/conftest.py)
    assert c.target.compile_cache_dir == COMPILE_CACHE_DIR


@pytest.mark.parametrize(
    "bad",
    [
        {"unknown_field": 1},
        {"speculation": {"num_speculative_tokens": 9, "max_speculative_tokens": 8}},
        {"speculation": {"mode": "parallel"}},
        {"placement_strategy": "RANDOM"},
        {"target_resources": {"num_gpus": -1}},
        {"draft": None, "placement_strategy": "STRICT_SPREAD"},
        {"speculation": {"proposers": []}},
        {"speculation": {"proposers": ["ngram", "ngram"]}},
        {"speculation": {"proposers": ["eagle"]}},
        {"speculation": {"ngram_min": 3, "ngram_max": 2}},
        {"faults": {"iteration_timeout_s": 0}},
        {"speculation": {"disable_by_batch_size": 0}},
        {"speculation": {"disable_by_batch_size": 8, "policy": "fixed"}},
    ],
)
def test_invalid_configs_are_rejected(bad):
    with pytest.raises(ValidationError):
        cfg(**bad)


@pytest.mark.parametrize(
    ("proposers", "args", "expected"),
    [
        # (enabled, requested k, seeded, has draft, method) -> (k, auto_k, method, auto_method)
        (["draft_model"], (True, None, False, True, None), (4, True, "draft_model", False)),
        (["draft_model", "ngram"], (True, None, False, True, None), (4, True, "draft_model", True)),
        (["ngram", "draft_model"], (True, None, False, True, None), (4, True, "ngram", True)),
        (["draft_model", "ngram"], (True, 2, False, True, None), (2, False, "draft_model", False)),
        (
            ["draft_model", "ngram"],
            (True, None, True, True, None),
            (4, False, "draft_model", False),
        ),
        (["draft_model", "ngram"], (True, None, False, False, None), (4, False, "ngram", False)),
        (["draft_model"], (True, None, False, False, None), (0, False, "draft_model", False)),
        (["draft_model"], (True, None, False, False, "ngram"), (4, False, "ngram", False)),
        (["draft_model"], (True, 3, False, True, "ngram"), (3, False, "ngram", False)),
        (["ngram"], (True, None, False, True, "draft_model"), (4, True, "draft_model", False)),
        (
            ["draft_model", "ngram"],
            (False, None, False, True, "ngram"),
            (0, False, "draft_model", False),
        ),
    ],
)
def test_the_draft_plan_rule(proposers, args, expected):
    """Who drafts a request and who chooses: a named proposer is used (n-gram lookup needs
    no draft); a fixed k alone means the draft model; unnamed requests get the first usable
    listed proposer, with the choice between several under the goodput policy, never for
    a seeded request (its draws must repeat)."""
    spec = cfg(speculation={"proposers": proposers}).speculation
    assert tuple(spec.draft_plan(*args)) == expected


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            for sub in getattr(ann, "__args__", (ann,)):
                if isinstance(sub, type) and hasattr(sub, "model_fields"):
                    walk(sub)

    walk(EngineConfig)


def test_bundle_from_resources():
    assert bundle(WorkerResources(num_cpus=1, num_gpus=1, accelerator_type="H100")) == {
        "CPU": 1,
        "GPU": 1,
        "accelerator_type:H100": 0.001,
    }
    assert bundle(WorkerResources(num_cpus=0, resources={"target": 1})) == {"target": 1}
    assert bundle(WorkerResources(num_cpus=0)) == {"CPU": 0.001}


def test_pack_places_engine_target_draft_in_three_bundles():
    p = placement_for(
        cfg(
            engine_resources={"num_cpus": 0.5},
            target_resources={"num_cpus": 1, "num_gpus": 1},
            draft_resources={"num_cpus": 1, "num_gpus": 1},
        )
    )
    assert p.bundles == [{"CPU": 0.5}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}]
    assert p.strategy == "PACK" and (p.target_bundle, p.draft_bundle) == (1, 2)


def test_strict_spread_puts_draft_and_target_on_different_nodes():
    p = placement_for(
        cfg(
            placement_strategy="STRICT_SPREAD",
            engine_resources={"num_cpus": 0.5},
            target_resources={"num_cpus": 1, "resources": {"target": 1}},
            draft_resources={"num_cpus": 1, "resources": {"draft": 1}},
        )
    )
    # Two bundles, so two nodes suffice: [engine + target], [draft].
    assert p.bundles == [{"CPU": 1.5, "target": 1}, {"CPU": 1, "draft": 1}]
    assert p.strategy == "STRICT_SPREAD" and (p.target_bundle, p.draft_bundle) == (0, 1)


def test_target_only_has_no_draft_bundle():
    p = placement_for(cfg(draft=None))
    assert len(p.bundles) == 2 and p.draft_bundle is None


def _claim(options: dict) -> dict[str, float]:
    """The resources Ray reserves for an actor with these options (no CPU default: every
    SpecServe actor states its num_cpus)."""
    out = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0)}
    out.update(options.get("resources") or {})
    if options.get("accelerator_type"):
        out[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    return {k: v for k, v in out.items() if v}


def _worker_options(res: WorkerResources) -> dict:
    """What the engine asks Ray for per worker (``WorkerLauncher.options``)."""
    return {
        "num_cpus": res.num_cpus,
        "num_gpus": res.num_gpus,
        "resources": dict(res.resources),
        "accelerator_type": res.accelerator_type,
    }


def _add(into: dict[str, float], claim: dict[str, float]) -> None:
    for key, value in claim.items():
        into[key] = into.get(key, 0) + value


GPU_SHAPE = {
    "engine_resources": {"num_cpus": 1},
    "target_resources": {
        "num_cpus": 4,
        "num_gpus": 1,
        "resources": {"target": 1},
        "accelerator_type": "H100",
    },
    "draft_resources": {"num_cpus": 2, "num_gpus": 1, "resources": {"draft": 1}},
}


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_SPREAD"])
@pytest.mark.parametrize(
    "engine",
    [
        {"num_cpus": 1},
        {"num_cpus": 0},
        {"num_cpus": 0.5, "num_gpus": 0.1, "resources": {"head": 1}, "accelerator_type": "L4"},
    ],
)
def test_replica_claims_the_engine_resources_and_bundles_sum(strategy, engine):
    """The replica asks for the engine's resources (never bundle 0's); every bundle is
    exactly what its actors claim, so the target and the draft always fit in theirs."""
    from deployments.placement import replica_actor_options

    c = cfg(**{**GPU_SHAPE, "engine_resources": engine}, placement_strategy=strategy)
    replica = replica_actor_options(c)
    assert replica["num_cpus"] == engine["num_cpus"]
    assert replica["num_gpus"] == engine.get("num_gpus", 0)
    assert replica.get("resources", {}) == engine.get("resources", {})
    assert replica.get("accelerator_type") == engine.get("accelerator_type")

    p = placement_for(c)
    assert p.strategy == strategy
    claims: list[dict[str, float]] = [{} for _ in p.bundles]
    _add(claims[0], _claim(replica))  # Serve schedules the replica in bundle 0
    _add(claims[p.target_bundle], _claim(_worker_options(c.target_resources)))
    _add(claims[p.draft_bundle], _claim(_worker_options(c.draft_resources)))
    for got, want in zip(p.bundles, claims, strict=True):
        # Equal, up to the CPU: 0.001 placeholder of a bundle nothing else would fill.
        assert {k: pytest.approx(v) for k, v in want.items()} == {
            k: v for k, v in got.items() if not (k == "CPU" and k not in want)
        }
    if strategy == "STRICT_SPREAD":
        # Two bundles on two nodes: [engine + target], [draft]; the target's GPU is its own.
        assert (p.target_bundle, p.draft_bundle) == (0, 1)
        assert p.bundles[0]["GPU"] - replica["num_gpus"] == 1
    else:
        assert (p.target_bundle, p.draft_bundle) == (1, 2)


def test_built_app_gives_the_replica_the_engine_resources():
    """build_specserve_app: STRICT_SPREAD with a GPU target no longer hands the target's
    GPU to the replica (the bug that kept the KubeRay shape from coming up)."""
    from deployments.app import build_app

    app = build_app(
        {
            "engine": {
                "target": {"model": "t"},
                "draft": {"model": "d"},
                **GPU_SHAPE,
                "placement_strategy": "STRICT_SPREAD",
            }
        }
    )
    assert app._bound_deployment.ray_actor_options == {"num_cpus": 1, "num_gpus": 0}


def test_a_colocated_draft_has_no_bundle_and_takes_turns():
    c = cfg(draft_placement="colocated", draft_resources={"num_gpus": 1})
    assert c.speculation.mode == "sequential"  # the overlap default does not apply
    p = placement_for(c)
    assert p.draft_bundle is None and len(p.bundles) == 2  # draft_resources unused


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"draft": None}, "needs a draft model"),
        ({"speculation": {"mode": "overlap"}}, "speculation.mode 'overlap'"),
        ({"transport": "compiled_graph"}, "transport"),
        ({"placement_strategy": "STRICT_SPREAD"}, "STRICT_SPREAD"),
        ({"draft": {"model": "d", "kv_cache_memory_bytes": 10**9}}, "draft.kv_cache_memory_bytes"),
        ({"draft": {"model": "d", "kv_cache_memory_fraction": 0.2}}, "draft.kv_cache_memory_frac"),
        ({"draft": {"model": "d", "device": "cuda:1"}}, "draft.device"),
    ],
)
def test_colocated_refusals_name_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        cfg(draft_placement="colocated", **bad)


def test_an_unset_draft_context_follows_the_target():
    """Left unset, the draft serves as far as the target was asked to (its own default,
    at most 8192, would stop drafting past it); a draft's own value stands."""
    longer = {"model": "t", "max_model_len": 32768}
    cfg = EngineConfig.model_validate({"target": longer, "draft": {"model": "d"}})
    assert cfg.draft.max_model_len == 32768
    both_unset = EngineConfig.model_validate({"target": {"model": "t"}, "draft": {"model": "d"}})
    assert both_unset.draft.max_model_len is None and both_unset.target.max_model_len is None
    own = {"model": "d", "max_model_len": 4096}
    assert EngineConfig.model_validate({"target": longer, "draft": own}).draft.max_model_len == 4096


def test_cuda_graphs_need_a_cuda_device():
    """Recording CUDA graphs needs CUDA: on a CPU the mode would pad every pass and record
    nothing, so a config that asks for it there is refused, naming both settings."""
    for device in ("auto", "cuda", "cuda:0"):
        spec = {"model": "t", "device": device, "execution_mode": "cuda_graph"}
        assert cfg(target=spec).target.execution_mode == "cuda_graph"
    with pytest.raises(ValidationError, match="execution_mode 'cuda_graph' needs a CUDA"):
        cfg(target={"model": "t", "device": "cpu", "execution_mode": "cuda_graph"})


def test_a_split_target_gets_a_bundle_per_rank_after_the_others():
    c = cfg(
        target={"model": "t", "tensor_parallel_size": 4},
        target_resources={"num_cpus": 2, "num_gpus": 1, "resources": {"target": 1}},
        draft_resources={"num_gpus": 1, "resources": {"draft": 1}},
    )
    p = placement_for(c)
    assert (p.target_bundle, p.draft_bundle, p.rank_bundles) == (1, 2, (3, 4, 5))
    assert all(p.bundles[i] == p.bundles[p.target_bundle] for i in p.rank_bundles)
    assert placement_for(cfg()).rank_bundles == ()  # a whole target: none


def test_a_split_draft_gets_a_bundle_per_rank_after_the_targets():
    c = cfg(
        target={"model": "t", "tensor_parallel_size": 2},
        draft={"model": "d", "tensor_parallel_size": 3},
        target_resources={"num_gpus": 1, "resources": {"target": 1}},
        draft_resources={"num_gpus": 1, "resources": {"draft": 1}},
    )
    p = placement_for(c)
    assert (p.target_bundle, p.draft_bundle, p.rank_bundles) == (1, 2, (3,))
    assert p.draft_rank_bundles == (4, 5)
    assert all(p.bundles[i] == p.bundles[p.draft_bundle] for i in p.draft_rank_bundles)
    whole = placement_for(cfg(target={"model": "t", "tensor_parallel_size": 2}))
    assert whole.draft_rank_bundles == ()
    whole_target = placement_for(cfg(draft={"model": "d", "tensor_parallel_size": 2}))
    assert (whole_target.rank_bundles, whole_target.draft_rank_bundles) == ((), (3,))


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"draft_placement": "colocated"}, "draft_placement 'colocated'"),
        ({"placement_strategy": "SPREAD"}, "draft.tensor_parallel_size > 1 keeps"),
        ({"placement_strategy": "STRICT_SPREAD"}, "draft.tensor_parallel_size > 1 keeps"),
        ({"draft_resources": {"num_gpus": 0.5}}, "draft_resources.num_gpus"),
        (
            {"draft": {"model": "d", "tensor_parallel_size": 2, "execution_mode": "torch_compile"}},
            "runs eager",
        ),
    ],
)
def test_split_draft_refusals_name_the_field(bad, field):
    kw = {"draft": {"model": "d", "tensor_parallel_size": 2}, **bad}
    with pytest.raises(ValidationError, match=field):
        cfg(**kw)


def test_an_adapted_draft_stays_whole():
    engine = {"target": {"model": "t"}, "draft": {"model": "d", "tensor_parallel_size": 2}}
    AppConfig.model_validate({"engine": engine})  # (no retention, no adaptation: fine)
    for adapting in (
        {"retention": {"enabled": True}},
        {"retention": {"enabled": True}, "enabled": False},
    ):
        # (runs off still deploy a rollback, and may be turned on at run time)
        with pytest.raises(ValidationError, match=r"adaptation\.retention\.enabled with draft"):
            AppConfig.model_validate({"engine": engine, "adaptation": adapting})


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"placement_strategy": "SPREAD"}, "SPREAD"),
        ({"placement_strategy": "STRICT_SPREAD"}, "STRICT_SPREAD"),
        (
            {
                "target": {
                    "model": "t",
                    "tensor_parallel_size": 2,
                    "execution_mode": "torch_compile",
                }
            },
            "runs eager",
        ),
        ({"target": {"model": "t", "tensor_parallel_size": 0}}, "tensor_parallel_size"),
        ({"target": {"model": "t", "tensor_parallel_size": 65}}, "tensor_parallel_size"),
        ({"faults": {"rank_timeout_s": 0}}, "rank_timeout_s"),
    ],
)
def test_split_target_refusals_name_the_field(bad, field):
    kw = {"target": {"model": "t", "tensor_parallel_size": 2}, **bad}
    with pytest.raises(ValidationError, match=field):
        cfg(**kw)


@pytest.mark.parametrize("cap", [8, None])
def test_disable_by_batch_size_reaches_the_length_policy(cap):
    """The setting (goodput policy) is the length policy's, as the core gets it."""
    from deployments.frontend.worker_launch import WorkerLauncher

    speculation = {"policy": "goodput", "disable_by_batch_size": cap}
    launched = WorkerLauncher(cfg(speculation=speculation))._length_policy()
    assert launched.disable_by_batch_size == cap
