"""The model-family matrix in one process: tiny random models from each family's real
config (tests/model_families.py), speculative decoding against transformers ``generate``
of the target, with prompts longer than every sliding window."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.attention import SLIDING
from specdec.generate import generate_speculative
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from tests.model_families import FAMILIES, WINDOW

NEW_TOKENS = 24


def prompts(tokenizer) -> list[list[int]]:
    """Three text prompts of 30-40 words, encoded as the tokenizer does by default."""
    out = []
    for n, step in ((30, 7919), (34, 104729), (40, 1299709)):
        words = " ".join(f"w{300 + (i * step) % 30000}" for i in range(n))
        out.append(tokenizer(words)["input_ids"])
    return out


def reference(model, prompt: list[int]) -> list[int]:
    """transformers greedy ``generate`` of the target, EOS ignored (as ``ignore_eos``)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_greedy_equals_generate_with_drafts_accepted(name, family_models):
    target_dir, draft_dir, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    family = FAMILIES[name]
    if family.bos is not None:  # the prompts carry BOS exactly as the tokenizer adds it
        assert all(p[0] == tokenizer.bos_token_id for p in prompts(tokenizer))
    target = ModelRunner(target_dir)
    draft = ModelRunner(draft_dir)
    proposer = DraftModelProposer(
        draft, vocab_limit=min(target.vocab_size, draft.vocab_size, len(tokenizer))
    )
    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    drafted = accepted = 0
    for prompt in prompts(tokenizer):
        if target.attention.has_sliding:
            assert len(prompt) > 2 * WINDOW
        ref = reference(hf, prompt)
        for k in (1, 4):
            spec = generate_speculative(target, proposer, prompt, params, k)
            assert spec.token_ids == ref, (name, k)
            drafted += spec.num_drafted
            accepted += spec.num_accepted
    assert 0 < accepted < drafted, (name, accepted, drafted)
    # A seeded sampled request speculates too, over the ids the pair shares.
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    out = generate_speculative(target, proposer, prompts(tokenizer)[0], sampled, 4)
    assert out.num_drafted > 0 and len(out.token_ids) == 16
    assert target.num_seqs == 0 and draft.num_seqs == 0


SLIDING_FAMILIES = [
    n for n, f in FAMILIES.items() if f.target.get("text_config", f.target).get("sliding_window")
]


def test_the_matrix_has_sliding_families():
    assert {"mistral", "gemma2", "gemma3", "phi3"} <= set(SLIDING_FAMILIES)


@pytest.mark.parametrize("name", SLIDING_FAMILIES)
def test_sliding_window_changes_these_outputs(name, family_models):
    """Power of the test above: without its window, each sliding family's greedy text
    differs from the reference (so a runner that ignored the window would fail)."""
    target_dir, _, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    runner = ModelRunner(target_dir)
    assert SLIDING in runner.attention.layer_types
    windowless = AutoModelForCausalLM.from_pretrained(target_dir)
    text_config = windowless.config.get_text_config(decoder=True)
    text_config.sliding_window = 10**6  # read per forward by transformers' mask builder
    differ = [reference(hf, p) != reference(windowless, p) for p in prompts(tokenizer)]
    assert any(differ), name
