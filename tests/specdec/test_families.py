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


def reference(
    model, prompt: list[int], new_tokens: int = NEW_TOKENS, eos: list[int] | None = None
) -> list[int]:
    """transformers greedy ``generate`` of the target: ``new_tokens`` tokens with EOS
    ignored (as ``ignore_eos``), or, with ``eos``, the tokens before the first of them
    (what a server returns)."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=new_tokens,
        min_new_tokens=None if eos else new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    ids = out[0, len(prompt) :].tolist()
    stops = [i for i, t in enumerate(ids) if t in (eos or ())]
    return ids[: stops[0]] if stops else ids


def assert_greedy_speculation_is_generate(
    target: ModelRunner, draft: ModelRunner, target_dir: str, tokenizer, new_tokens: int
) -> None:
    """Greedy speculative decoding (k = 4) of two prompts gives transformers' greedy
    ``generate`` of the target, with some drafts accepted (the drafts' ids limited to
    what both models and the tokenizer know)."""
    proposer = DraftModelProposer(
        draft, vocab_limit=min(target.vocab_size, draft.vocab_size, len(tokenizer))
    )
    hf = AutoModelForCausalLM.from_pretrained(target_dir).to(target.device)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    accepted = 0
    for prompt in prompts(tokenizer)[:2]:
        spec = generate_speculative(target, proposer, prompt, params, 4)
        assert spec.token_ids == reference(hf, prompt, new_tokens=new_tokens), target_dir
        accepted += spec.num_accepted
    assert accepted > 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_greedy_equals_generate_with_drafts_accepted(name, family_models, device):
    target_dir, draft_dir, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    family = FAMILIES[name]
    if family.bos is not None:  # the prompts carry BOS exactly as the tokenizer adds it
        assert all(p[0] == tokenizer.bos_token_id for p in prompts(tokenizer))
    target = ModelRunner(target_dir, max_model_len=512, device=device)
    draft = ModelRunner(draft_dir, max_model_len=512, device=device)
    proposer = DraftModelProposer(
        draft, vocab_limit=min(target.vocab_size, draft.vocab_size, len(tokenizer))
    )
    hf = AutoModelForCausalLM.from_pretrained(target_dir).to(device)
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
    runner = ModelRunner(target_dir, max_model_len=512)
    assert SLIDING in runner.attention.layer_types
    windowless = AutoModelForCausalLM.from_pretrained(target_dir)
    text_config = windowless.config.get_text_config(decoder=True)
    text_config.sliding_window = 10**6  # read per forward by transformers' mask builder
    differ = [reference(hf, p) != reference(windowless, p) for p in prompts(tokenizer)]
    assert any(differ), name


def test_longrope_is_served_up_to_its_pretraining_length(tmp_path):
    """Phi-3 128k-style LongRoPE switches every position's frequencies once a sequence
    passes ``original_max_position_embeddings``: exact below it, so served up to it."""
    from transformers import AutoConfig

    from specdec.generate import generate_autoregressive

    config = AutoConfig.for_model(
        "phi3",
        vocab_size=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=128,
        original_max_position_embeddings=24,  # top level, as Phi-3 128k configs have it
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0 + i for i in range(8)],
            "original_max_position_embeddings": 24,
        },
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    model.save_pretrained(tmp_path)
    runner = ModelRunner(str(tmp_path))
    assert runner.max_model_len == 24
    prompt = list(range(30, 42))
    ref = reference(model, prompt, 12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert generate_autoregressive(runner, prompt, params).token_ids == ref
    with pytest.raises(ValueError, match="max_model_len"):
        generate_autoregressive(runner, prompt, SamplingParams(temperature=0.0, max_tokens=14))
    # Why the limit: past it, a cache that keeps its keys no longer matches generate.
    runner.max_model_len = 128
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref_long = reference(model, prompt, 40)
    assert generate_autoregressive(runner, prompt, long).token_ids != ref_long


@pytest.mark.parametrize("name", SLIDING_FAMILIES)
def test_ragged_batches_of_sliding_families_match_full_forwards(name, family_models, device):
    """Two rows at different lengths, prefilled and then verified in ragged multi-token
    chunks in one batch: every logit row equals the model's own full forward pass."""
    target_dir, _, _ = family_models[name]
    runner = ModelRunner(target_dir, max_model_len=512, device=device)
    hf = AutoModelForCausalLM.from_pretrained(target_dir).to(device)
    seqs = [list(range(300, 340)), list(range(900, 931))]  # both longer than the window
    with torch.no_grad():  # [len, vocab] each
        full = [hf(torch.tensor([s], device=device)).logits[0].float() for s in seqs]
    runner.prefill(["a", "b"], [seqs[0][:14], seqs[1][:5]])
    done = [14, 5]
    for step in (4, 1, 5, 3, 2, 6, 4):
        feeds = [s[d : d + step + i] for i, (s, d) in enumerate(zip(seqs, done, strict=True))]
        feeds = [f or s[-1:] for f, s in zip(feeds, seqs, strict=True)]
        if any(d >= len(s) for d, s in zip(done, seqs, strict=True)):
            break
        out = runner.forward(["a", "b"], feeds)
        for i, f in enumerate(feeds):
            ref = full[i][done[i] : done[i] + len(f)]
            assert torch.allclose(out[i], ref, atol=1e-3, rtol=1e-3), (name, i, done[i])
            done[i] += len(f)
    assert min(done) > 2 * WINDOW
