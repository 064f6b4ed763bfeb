"""Config validation and placement bundles: pure, no cluster."""

import pytest
from pydantic import ValidationError

from deployments.config import EngineConfig, WorkerResources
from deployments.placement import bundle, placement_for


def cfg(**kw):
    base = {"target": {"model": "t"}, "draft": {"model": "d"}}
    base.update(kw)
    return EngineConfig.model_validate(base)


def test_defaults_and_model_name():
    c = cfg(target={"model": "org/big-8b/"})
    assert c.speculation.mode == "overlap"
    assert c.model_name == "big-8b"
    assert cfg(served_model_name="x").model_name == "x"


@pytest.mark.parametrize(
    "bad",
    [
        {"unknown_field": 1},
        {"speculation": {"num_speculative_tokens": 9, "max_speculative_tokens": 8}},
        {"speculation": {"mode": "parallel"}},
        {"placement_strategy": "RANDOM"},
        {"target_resources": {"num_gpus": -1}},
        {"draft": None, "placement_strategy": "STRICT_SPREAD"},
    ],
)
def test_invalid_configs_are_rejected(bad):
    with pytest.raises(ValidationError):
        cfg(**bad)


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
