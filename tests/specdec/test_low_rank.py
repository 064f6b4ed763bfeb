"""New draft weights as low-rank factors: merged in place, exactly as the full merged
weights would load, and refused whole when anything does not fit."""

import pytest
import torch

from specdec.low_rank import LowRankUpdate, merged
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState

NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight")


def factors(runner, rank=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = runner.model.state_dict()
    out = {}
    for name in NAMES:
        out_f, in_f = params[name].shape
        out[name] = (
            torch.randn(rank, in_f, generator=gen),
            torch.randn(out_f, rank, generator=gen),
        )
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_factors_merge_in_place_bit_for_bit_as_the_full_weights_load(tiny_draft, dtype):
    runner = ModelRunner(tiny_draft, max_num_seqs=2, dtype=dtype)
    update = LowRankUpdate(0, factors(runner), scale=0.5)
    base = {k: v.clone() for k, v in runner.model.state_dict().items()}
    full = {
        k: merged(v, *update.factors[k], 0.5) if k in update.factors else v for k, v in base.items()
    }
    ptrs = {k: v.data_ptr() for k, v in runner.model.state_dict().items()}
    runner.add_low_rank(update)
    other = ModelRunner(tiny_draft, max_num_seqs=2, dtype=dtype)
    other.load_weights(full)
    for k, v in runner.model.state_dict().items():
        assert torch.equal(v, other.model.state_dict()[k]), k
        assert v.data_ptr() == ptrs[k], k  # in place: compiled graphs keep their inputs
        assert torch.equal(v, base[k]) == (k not in NAMES), k


def test_an_update_that_does_not_fit_is_refused_untouched(tiny_draft):
    runner = ModelRunner(tiny_draft, max_num_seqs=2)
    good = factors(runner)
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    a, b = good[NAMES[0]]
    cases = (
        ({**good, "model.nope.weight": (a, b)}, "unknown"),
        ({**good, NAMES[0]: (a[:, :3], b)}, "do not make"),
        ({**good, NAMES[0]: (a, torch.full_like(b, float("inf")))}, "not finite"),
        ({**good, NAMES[0]: (a * 1e30, b * 1e30)}, "merges to non-finite"),
        ({**good, NAMES[0]: (a,)}, "not a pair"),
    )
    for bad, words in cases:
        with pytest.raises(ValueError, match=words):
            runner.add_low_rank(LowRankUpdate(0, bad, 1.0))
        for k, v in runner.model.state_dict().items():
            assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="scale"):
        runner.add_low_rank(LowRankUpdate(0, good, float("nan")))


def test_a_proposer_updated_by_factors_drafts_as_a_fresh_draft_with_the_merged_weights(tiny_draft):
    """The lazy cache rebuild holds for factors as for full weights; its wrong twin (the
    factors merged, the old cache kept) drafts differently."""
    params = SamplingParams(temperature=0.0)

    def seqs():
        return [SequenceState("a", [5, 9, 14, 3], params), SequenceState("b", [7, 8], params)]

    def updated(rebuild: bool):
        proposer = DraftModelProposer(ModelRunner(tiny_draft, max_num_seqs=4))
        ss = seqs()
        proposer.propose(ss, 2, 2)
        update = LowRankUpdate(0, factors(proposer.runner, seed=1), 2.0)
        if rebuild:
            proposer.load_weights(update)
        else:
            proposer.runner.add_low_rank(update)
        return proposer.propose(ss, 4, 4), update

    got, update = updated(rebuild=True)
    fresh_runner = ModelRunner(tiny_draft, max_num_seqs=4)
    fresh_runner.add_low_rank(update)
    fresh = DraftModelProposer(fresh_runner).propose(seqs(), 4, 4)
    assert got.host_draft_token_ids == fresh.host_draft_token_ids
    torch.testing.assert_close(got.top_probs, fresh.top_probs, atol=1e-5, rtol=1e-4)
    stale, _ = updated(rebuild=False)
    assert not torch.allclose(stale.top_probs, fresh.top_probs, atol=1e-3)
