"""Reference loops: speculative == autoregressive under greedy; seeded determinism; exactness."""

import pytest
import torch
from scipy.stats import chisquare

from specdec.generate import generate_autoregressive, generate_speculative
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_for

PROMPTS = [[5, 9, 14], [30, 31, 32, 33, 34], [7], [60, 2, 61, 3, 62, 4, 63], [11, 12, 11, 12, 11]]


@pytest.fixture(scope="module")
def target(tiny_target, device):
    return ModelRunner(tiny_target, device=device)


@pytest.fixture(scope="module")
def draft_proposer(tiny_draft, device):
    return DraftModelProposer(ModelRunner(tiny_draft, device=device))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_autoregressive(target, draft_proposer, k):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    drafted = accepted = 0
    for prompt in PROMPTS:
        ref = generate_autoregressive(target, prompt, params)
        spec = generate_speculative(target, draft_proposer, prompt, params, k)
        assert spec.token_ids == ref.token_ids
        assert len(spec.token_ids) == 24 and spec.finish_reason == "length"
        drafted += spec.num_drafted
        accepted += spec.num_accepted
    # The draft must neither always agree nor never agree, or the test proves nothing.
    assert 0 < accepted < drafted
    assert target.num_seqs == 0 and draft_proposer.runner.num_seqs == 0


def test_greedy_ngram_speculative_equals_autoregressive(target):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    drafted = accepted = 0
    for prompt in PROMPTS:
        ref = generate_autoregressive(target, prompt, params)
        spec = generate_speculative(target, NgramProposer(n_max=3), prompt, params, 4)
        assert spec.token_ids == ref.token_ids
        drafted += spec.num_drafted
        accepted += spec.num_accepted
    assert 0 < accepted < drafted


def test_eos_and_stop_token_ids_end_generation(target, draft_proposer):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = generate_autoregressive(target, PROMPTS[0], params).token_ids
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    for eos, stop in [(stop_tok, ()), (None, (stop_tok,))]:
        p = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=stop)
        spec = generate_speculative(target, draft_proposer, PROMPTS[0], p, 4, eos_token_id=eos)
        assert spec.token_ids == ref[: first + 1]
        assert spec.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(target, draft_proposer):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=20, ignore_eos=True)
    a = generate_speculative(target, draft_proposer, PROMPTS[1], params, 3)
    b = generate_speculative(target, draft_proposer, PROMPTS[1], params, 3)
    assert a.token_ids == b.token_ids
    c = generate_speculative(
        target,
        draft_proposer,
        PROMPTS[1],
        SamplingParams(temperature=1.0, seed=43, max_tokens=20),
        3,
    )
    assert c.token_ids != a.token_ids
    ar1 = generate_autoregressive(target, PROMPTS[1], params)
    ar2 = generate_autoregressive(target, PROMPTS[1], params)
    assert ar1.token_ids == ar2.token_ids


def test_sampled_tokens_follow_target_end_to_end(target, draft_proposer):
    """Joint law of the first three tokens (top_k=2: 8 outcomes) vs. the exact target law.

    Token 1 comes from prefill; tokens 2 and 3 from one speculative round with k=2, so
    acceptance, rejection+recovery and bonus paths are all exercised on real models.
    """
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)
    prompt = PROMPTS[0]
    torch.manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    n = 1200
    for _ in range(n):
        out = generate_speculative(target, draft_proposer, prompt, params, 2).token_ids
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1

    # Exact law by enumeration with full forward passes.
    def dist(tokens):
        with torch.no_grad():
            logits = target.model(torch.tensor([tokens], device=target.device)).logits[:, -1]
        return probs_for([params], logits)[0]

    expected: dict[tuple[int, ...], float] = {}
    d0 = dist(prompt)
    for t0 in d0.nonzero()[:, 0].tolist():
        d1 = dist([*prompt, t0])
        for t1 in d1.nonzero()[:, 0].tolist():
            d2 = dist([*prompt, t0, t1])
            for t2 in d2.nonzero()[:, 0].tolist():
                expected[(t0, t1, t2)] = float(d0[t0] * d1[t1] * d2[t2])
    assert set(counts) <= set(expected)
    keys = sorted(expected)
    obs = [counts.get(key, 0) for key in keys]
    total = sum(expected.values())  # 1 up to float32 rounding
    exp = [expected[key] * sum(obs) / total for key in keys]
    assert chisquare(obs, exp).pvalue > 1e-3


def _exact_law(runner, prompt, params, depth):
    """Law of the first ``depth`` tokens under one model, by enumeration (top-k keeps it small)."""

    def dist(tokens):
        with torch.no_grad():
            logits = runner.model(torch.tensor([tokens], device=runner.device)).logits[:, -1]
        return probs_for([params], logits)[0]

    law: dict[tuple[int, ...], float] = {}

    def expand(prefix, prob):
        if len(prefix) - len(prompt) == depth:
            law[tuple(prefix[len(prompt) :])] = prob
            return
        d = dist(prefix)
        for t in d.nonzero()[:, 0].tolist():
            expand([*prefix, t], prob * float(d[t]))

    expand(list(prompt), 1.0)
    return law


def test_dynamic_draft_length_is_exact(target, tiny_draft):
    """min_confidence ends rows early (a different number of drafts per round): greedy output
    still equals target-only output, and the joint law of five sampled tokens (prefill, then
    rounds with 1-3 drafts: every position and the bonus) is the target's; the same samples
    reject the draft's law (the wrong twin)."""
    proposer = DraftModelProposer(
        ModelRunner(tiny_draft, device=target.device), min_confidence=0.12
    )  # about the median draft confidence
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lengths = set()
    for prompt in PROMPTS:
        spec = generate_speculative(target, proposer, prompt, greedy, 4)
        assert spec.token_ids == generate_autoregressive(target, prompt, greedy).token_ids
        lengths |= {r.num_draft_tokens for r in spec.rounds}
    assert 4 in lengths and lengths & {1, 2, 3}

    proposer.min_confidence = 0.075  # sampled tokens are less likely than the argmax
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=5, ignore_eos=True)
    prompt, n, depth = PROMPTS[0], 800, 5
    torch.manual_seed(1)
    counts: dict[tuple[int, ...], int] = {}
    lengths = set()
    for _ in range(n):
        out = generate_speculative(target, proposer, prompt, params, 3)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        lengths |= {r.num_draft_tokens for r in out.rounds}
    assert 3 in lengths and lengths & {1, 2}
    law = _exact_law(target, prompt, params, depth)
    assert set(counts) <= set(law)

    def pvalue(expected):
        keys = sorted(set(expected) | set(counts))
        obs = [counts.get(key, 0) for key in keys]
        exp = [max(expected.get(key, 0.0), 1e-9) for key in keys]
        return chisquare(obs, [e * n / sum(exp) for e in exp]).pvalue

    p_target = pvalue(law)
    p_draft = pvalue(_exact_law(proposer.runner, prompt, params, depth))
    print(f"dynamic draft length: p vs target law {p_target:.3g}, vs draft law {p_draft:.3g}")
    assert p_target > 1e-3
    assert p_draft < 1e-6


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_generators_follow_the_tensors_device(tiny_target, tiny_draft, device):
    """Seeded sampling draws with generators on the device of the logits (a CPU generator
    cannot draw for CUDA tensors): verify streams come from the sequence's device, draft
    streams from the draft logits' device, and seeded output reproduces on that device."""
    from specdec.sequence import SequenceState

    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    seq = SequenceState("s", [5, 9], params, device=device)
    assert seq.verify_generator_at(2).device.type == device
    assert seq.draft_generator_at(3).device.type == device
    assert seq.draft_generator_at(3, torch.device("cpu")).device.type == "cpu"
    target = ModelRunner(tiny_target, device=device)
    outs = [
        generate_speculative(
            target,
            DraftModelProposer(ModelRunner(tiny_draft, device=device)),
            [5, 9],
            params,
            3,
            seq_id=i,
        ).token_ids
        for i in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 12
