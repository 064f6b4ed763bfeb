"""One adaptation run without Ray: a candidate trained on a target's committed outputs,
judged on held-back requests, its weights kept only when deployed."""

import pytest
import torch

from adaptation.candidate import DraftSource, load_draft, run
from adaptation.config import TrainerConfig
from adaptation.retention import RetainedRequest
from specdec.generate import generate_autoregressive
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def served(tiny_target):
    """What retention keeps of two domains: in "e" the tiny target's greedy outputs; in
    "d" a target that counts on from the prompt's last token (a shift the draft never
    saw, and one it can learn from 13 requests: the run's gain is far above noise)."""
    runner = ModelRunner(tiny_target)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    out = {}
    for domain, n in (("d", 16), ("e", 5)):
        out[domain] = []
        for _ in range(n):
            prompt = torch.randint(3, 60, (6,), generator=gen).tolist()
            if domain == "d":
                tokens = [3 + (prompt[-1] - 3 + i) % 80 for i in range(1, 13)]
            else:
                tokens = generate_autoregressive(runner, prompt, params).token_ids
            out[domain].append(RetainedRequest(domain, tuple(prompt), tuple(tokens), 0.0))
    return out


def config(**kw) -> TrainerConfig:
    return TrainerConfig(**{"steps": 40, "lr": 3e-3, "batch_size": 8, **kw})


def test_a_run_gains_on_its_domain_and_ships_weights_in_the_serving_dtype(tiny_draft, served):
    source = DraftSource(tiny_draft, "bfloat16")
    result = run(source, None, "d", served, config(min_gain=0.0, max_loss=1.0))
    assert result.after["d"] > result.before["d"] + 0.5, (result.before, result.after)
    assert set(result.before) == {"d", "e"} and result.held_back_requests == 3
    assert result.train_requests == 13 and result.train["steps"] == 40
    assert result.verdict.deploy and result.weights is not None
    assert {v.dtype for v in result.weights.values()} == {torch.bfloat16}
    # The weights load into a runner of the draft (the swap's check), and a next run
    # starts from them rather than from the checkpoint.
    ModelRunner(tiny_draft, dtype="bfloat16").load_weights(result.weights)
    again = load_draft(source, result.weights)
    name = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(again.state_dict()[name], result.weights[name].float())
    assert "weights" not in result.summary() and result.summary()["verdict"]["deploy"]


def test_a_run_that_gains_too_little_is_rejected_without_weights(tiny_draft, served):
    result = run(DraftSource(tiny_draft, "float32"), None, "d", served, config(min_gain=2.0))
    assert not result.verdict.deploy and result.weights is None
    assert "min_gain" in result.verdict.reason


def test_a_domain_with_too_few_requests_is_refused(tiny_draft, served):
    with pytest.raises(ValueError, match="not enough retained requests"):
        run(DraftSource(tiny_draft, "float32"), None, "zz", served, config())


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_a_draft_above_adapter_min_params_trains_adapters_and_ships_their_factors(
    tiny_draft, served, which
):
    """With ``adapter_min_params`` below the draft's size the run trains LoRA adapters
    (peft) on the linear layers (its loss falls; this shift needs the output layer, which
    adapters leave alone, so it gains little here), and what it ships is the factors over
    the version it started from, which a runner of that version merges into exactly the
    full weights the run also keeps (for rollbacks, exports, replicas elsewhere)."""
    from specdec.low_rank import LowRankUpdate
    from tests.conftest import DEMO_DRAFT

    draft = tiny_draft if which == "tiny" else DEMO_DRAFT  # (the demo draft: 0.74 M params)
    source = DraftSource(draft, "bfloat16")
    cfg = config(min_gain=0.0, max_loss=1.0, adapter_min_params=1, lora_rank=4, lr=1e-2)
    result = run(source, None, "d", served, cfg, base_version=3)
    assert result.train["last_loss"] < result.train["first_loss"] - 0.1, result.train
    update = result.update
    assert isinstance(update, LowRankUpdate) and update.base_version == 3
    assert update.factors and all(a.shape[0] == 4 for a, _ in update.factors.values())
    assert "lm_head.weight" not in update.factors
    assert result.summary()["adapters"]["tensors"] == len(update.factors)
    runner = ModelRunner(draft, dtype="bfloat16")
    untouched = {k: v.clone() for k, v in runner.model.state_dict().items()}
    runner.add_low_rank(update)
    for name, value in runner.model.state_dict().items():
        assert torch.equal(value, result.weights[name]), name
        assert torch.equal(value, untouched[name]) == (name not in update.factors), name
