"""Device-clean without a GPU: the models sit on the CPU and torch's default device is
``meta``, so any tensor the hot path creates without naming its model's device lands on
meta and the first operation that mixes it with a real tensor raises. Every path runs and
gives exactly what it gives with a normal default device."""

import pytest
import torch

from specdec.generate import generate_autoregressive, generate_speculative
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.speculation_cache import SpeculativeDrafter

PROMPT = [5, 9, 14, 30, 31]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    "sampled": SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
    "top_k_top_p": SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, max_tokens=16, ignore_eos=True
    ),
    "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True),
    "seeded_top_p": SamplingParams(
        temperature=0.7, top_p=0.8, seed=4, max_tokens=16, ignore_eos=True
    ),
}
# The confidence stop for the ragged batch: the tiny draft is unsure enough that some rows
# stop early and sure enough that others go on.
RAGGED_CONFIDENCE = 0.05


@pytest.fixture
def meta_default():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.fixture(scope="module")
def runners(tiny_target, tiny_draft):
    return ModelRunner(tiny_target, device="cpu"), ModelRunner(tiny_draft, device="cpu")


def _all_paths(target, draft):
    torch.manual_seed(0)  # unseeded rows draw from the global generator
    out = {}
    for name, params in PARAMS.items():
        for conf in (0.0, 0.4):  # fixed k, and the dynamic draft length
            proposer = DraftModelProposer(draft, min_confidence=conf)
            r = generate_speculative(target, proposer, PROMPT, params, 4, seq_id=name)
            out[name, conf] = (r.token_ids, r.num_drafted)
    out["ngram"] = generate_speculative(
        target, NgramProposer(), PROMPT * 3, PARAMS["greedy"], 3
    ).token_ids
    out["plain"] = generate_autoregressive(target, PROMPT, PARAMS["seeded"]).token_ids
    return out


def _branches(draft):
    """The speculation cache: drafts, then branches for the likeliest outcomes."""
    torch.manual_seed(1)
    drafter = SpeculativeDrafter(DraftModelProposer(draft))
    try:
        for i, params in enumerate(PARAMS.values()):
            drafter.add(f"b{i}", [*PROMPT, i], params)
        ids = [f"b{i}" for i in range(len(PARAMS))]
        drafts = drafter.propose(ids, [3] * len(ids))
        branches = drafter.speculate(ids, budget=6)
        return [d.tokens for d in drafts], len(branches)
    finally:
        for sid in list(drafter.seqs):
            drafter.free(sid)


def _ragged_dynamic_lengths(draft, min_confidence: float):
    """One batch of every kind of row with the confidence stop: rows stop drafting at
    different steps, so later steps run on a subset of the batch (indexed writes)."""
    torch.manual_seed(2)
    proposer = DraftModelProposer(draft, min_confidence=min_confidence)
    drafter = SpeculativeDrafter(proposer)
    try:
        for i, params in enumerate([*PARAMS.values(), PARAMS["greedy"], PARAMS["sampled"]]):
            drafter.add(f"r{i}", [*PROMPT, 3 * i + 1], params)
        ids = list(drafter.seqs)
        return [d.tokens for d in drafter.propose(ids, [6] * len(ids))]
    finally:
        for sid in list(drafter.seqs):
            drafter.free(sid)


def test_hot_path_makes_nothing_on_the_default_device(runners, meta_default):
    target, draft = runners
    on_meta = _all_paths(target, draft)
    meta_branches = _branches(draft)
    meta_ragged = _ragged_dynamic_lengths(draft, RAGGED_CONFIDENCE)
    torch.set_default_device(None)
    assert on_meta == _all_paths(target, draft)  # the same tokens (seeded rows) and counts
    assert meta_branches == _branches(draft) and meta_branches[1] > 0
    assert meta_ragged == _ragged_dynamic_lengths(draft, RAGGED_CONFIDENCE)
    lengths = sorted({len(t) for t in meta_ragged})
    assert len(lengths) > 1 and lengths[-1] > 1, lengths  # rows stopped at different steps
    assert all(on_meta[name, 0.0][1] > 0 for name in PARAMS)  # drafts at every setting
    assert target.num_seqs == 0 and draft.num_seqs == 0


def test_a_failing_call_leaves_no_sequence_behind(runners, meta_default):
    target, draft = runners
    too_long = list(range(target.max_model_len + 1))
    for params in PARAMS.values():
        with pytest.raises(ValueError, match="max_model_len"):
            generate_speculative(target, DraftModelProposer(draft), too_long, params, 4)
        with pytest.raises(ValueError, match="max_model_len"):
            generate_autoregressive(target, too_long, params)
    assert target.num_seqs == 0 and draft.num_seqs == 0
    # The same ids work again at once.
    assert (
        len(
            generate_speculative(
                target, DraftModelProposer(draft), PROMPT, PARAMS["greedy"], 4
            ).token_ids
        )
        == 16
    )
