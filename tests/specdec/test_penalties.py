"""Penalties and min_tokens: the formulas, position by position, and on real models.

The statistical exactness of penalised speculation (every draft position and the bonus,
with wrong twins) is in ``test_penalties_law.py``.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from specdec.generate import generate_autoregressive, generate_speculative
from specdec.penalties import apply_history, needs_history
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams

PROMPTS = [[5, 9, 14], [30, 31, 32, 33, 34], [11, 12, 11, 12, 11]]


def test_repetition_penalty_equals_transformers():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    prompt, output = [3, 7, 7, 40], [9, 3, 12]
    ours = apply_history(logits, SamplingParams(repetition_penalty=1.7), prompt, output)
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_frequency_presence_and_min_tokens_by_hand():
    logits = torch.zeros(1, 6)
    params = SamplingParams(
        frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3, all_stop_token_ids=(5, 2)
    )
    out = apply_history(logits, params, [1, 1, 4], [4, 4, 0])[0]  # 3 outputs: min reached
    # Prompt tokens are not counted by frequency/presence (only repetition sees them).
    assert out.tolist() == [-0.75, 0.0, 0.0, 0.0, -1.25, 0.0]
    short = apply_history(logits, params, [1], [4])[0]  # 1 output < 3: stops banned
    assert short[5] == float("-inf") and short[2] == float("-inf") and short[4] == -0.75


def test_each_position_counts_the_drafts_before_it():
    """Position j of a verification pass == the same logits processed with drafts[:j]
    appended to the output: what plain decoding would have used there."""
    torch.manual_seed(1)
    params = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=-0.3,
        min_tokens=4,
        all_stop_token_ids=(7,),
    )
    prompt, output, drafts = [1, 2], [3, 7], [3, 8, 8, 60]  # 60 is past the vocabulary
    logits = torch.randn(5, 20)
    got = apply_history(logits, params, prompt, output, drafts)
    for j in range(5):
        alone = apply_history(logits[j : j + 1], params, prompt, output + drafts[:j])[0]
        torch.testing.assert_close(got[j], alone)
    assert got[1, 7] == float("-inf") and got[2, 7] > float("-inf")  # 3 outputs, then 4


def test_neutral_params_need_no_history_and_change_nothing():
    assert not needs_history(SamplingParams())
    assert not needs_history(SamplingParams(min_tokens=3))  # nothing to ban
    assert needs_history(SamplingParams(min_tokens=3).with_stops([2]))
    assert SamplingParams(ignore_eos=True, min_tokens=3).with_stops([2]).all_stop_token_ids == ()
    logits = torch.randn(2, 9)
    torch.testing.assert_close(apply_history(logits, SamplingParams(), [1], [2], [3]), logits)


@pytest.mark.parametrize(
    "bad",
    [
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 2.5},
        {"frequency_penalty": 2.1},
        {"presence_penalty": float("nan")},
        {"min_tokens": -1},
        {"min_tokens": 17},
    ],
)
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(max_tokens=16, **bad)


@pytest.fixture(scope="module")
def target(tiny_target):
    return ModelRunner(tiny_target)


@pytest.fixture(scope="module")
def draft_proposer(tiny_draft):
    return DraftModelProposer(ModelRunner(tiny_draft))


PENALISED = [
    SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.8, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=20, frequency_penalty=1.5, presence_penalty=0.8),
    SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, repetition_penalty=0.7),
]


@pytest.mark.parametrize("params", PENALISED, ids=["repetition", "frequency_presence", "min"])
def test_greedy_speculative_with_penalties_equals_autoregressive(target, draft_proposer, params):
    """Greedy: the same tokens with and without speculation; and the penalties change the
    output (else this would prove nothing)."""
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    changed = drafted = accepted = 0
    for prompt in PROMPTS:
        unpenalised = generate_autoregressive(target, prompt, plain).token_ids
        eos = unpenalised[2]  # plain greedy would stop at its third token
        ref = generate_autoregressive(target, prompt, params, eos_token_id=eos)
        spec = generate_speculative(target, draft_proposer, prompt, params, 4, eos_token_id=eos)
        assert spec.token_ids == ref.token_ids
        assert len(ref.token_ids) >= params.min_tokens  # min_tokens held the EOS back
        changed += ref.token_ids != unpenalised
        drafted += spec.num_drafted
        accepted += spec.num_accepted
    assert changed and 0 < accepted < drafted


def test_greedy_repetition_and_min_tokens_equal_transformers_generate(tiny_target, target):
    """Against transformers' own ``repetition_penalty`` and ``min_new_tokens``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    eos = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        hf = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=10,
            repetition_penalty=1.6,
            eos_token_id=eos,
            pad_token_id=eos,
        )[0, len(prompt) :].tolist()
        params = SamplingParams(
            temperature=0.0, max_tokens=16, min_tokens=10, repetition_penalty=1.6
        )
        ours = generate_autoregressive(target, prompt, params, eos_token_id=eos).token_ids
        assert ours == hf[: len(ours)] and (len(ours) == 16 or ours[-1] == eos)
