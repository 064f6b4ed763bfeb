"""Joint law of penalised speculative decoding (penalties and min_tokens), with wrong twins.

With penalties the next-token law depends on the whole output, so a verifier that
processed draft position ``j`` without the drafts ``0..j-1`` in the history would use the
wrong ``p`` there, and a draft that reported a ``q`` other than the one it sampled from
would bias acceptance. This file decodes the Markov-chain pair of ``test_joint_law.py``
through :func:`specdec.verify.verify_rows` (the engine's path: raw logits in, penalties
applied inside) with k = 4 over 7 tokens, so every draft position and the bonus land in
the window (asserted), and compares the law of whole sequences and of each consecutive
pair with the exact penalised law computed by enumeration. The same test, same sizes,
rejects two wrong twins:

* ``p_without_drafts``: the verifier processes every position with the committed
  output only (drafts not counted);
* ``q_without_drafts``: the draft samples from its correctly processed ``q`` but
  reports ``q`` processed without its own earlier drafts.
"""

from __future__ import annotations

import pytest
import torch

import specdec.verify
from specdec.penalties import apply_history
from specdec.rejection import PAD_TOKEN_ID
from specdec.sampling import SamplingParams, probs_for
from specdec.verify import VerifyRow, verify_rows
from tests.specdec.test_joint_law import (
    P_LOGITS,
    Q_LOGITS,
    START,
    K,
    L,
    Rollout,
    V,
    assert_covered,
    binned_chisquare,
    encode,
    report,
)

N = 5_000  # sequences per run (verify_rows and the penalties loop over rows in Python)
ALPHA = 1e-3  # the real path must give p > ALPHA, each twin p < ALPHA
EOS = 4  # banned by min_tokens for the first 3 tokens, an ordinary token after that

SAMPLED = SamplingParams(
    temperature=1.0,
    repetition_penalty=1.6,
    frequency_penalty=0.7,
    presence_penalty=0.4,
    min_tokens=3,
    all_stop_token_ids=(EOS,),
)
FILTERED = SamplingParams(
    temperature=0.9,
    top_k=4,
    repetition_penalty=1.4,
    frequency_penalty=-0.3,
    presence_penalty=0.9,
    min_tokens=2,
    all_stop_token_ids=(EOS,),
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def penalised(
    logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor, n_out: torch.Tensor
) -> torch.Tensor:
    """``[M, V]`` distributions after the penalties, min_tokens and the transform, written
    out here again (vectorised, independently of :mod:`specdec.penalties`).

    counts: [M, V] output token counts; n_out: [M] output lengths; the prompt is START.
    """
    seen = counts > 0
    in_prompt = torch.nn.functional.one_hot(torch.tensor(START), V).bool()  # [V]
    r = params.repetition_penalty
    logits = torch.where(seen | in_prompt, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * seen.float()
    short = (n_out < params.min_tokens)[:, None]  # [M, 1]
    banned = torch.zeros(V, dtype=torch.bool)
    banned[list(params.all_stop_token_ids)] = True
    logits = logits.masked_fill(short & banned, float("-inf"))
    return probs_for([params] * logits.shape[0], logits)


def exact_law(params: SamplingParams) -> torch.Tensor:
    """P(x_0..x_{L-1}) for every sequence, by enumeration of prefixes: ``[V**L]`` float64
    (index as :func:`test_joint_law.encode`)."""
    law = torch.ones(1, dtype=torch.float64)
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # [M, j]
    for j in range(L):
        m = prefixes.shape[0]
        prev = prefixes[:, -1] if j else torch.full((m,), START)
        counts = torch.nn.functional.one_hot(prefixes, V).sum(1).float()  # [M, V]
        nxt = penalised(P_LOGITS[prev], params, counts, torch.full((m,), j)).double()
        law = (law[:, None] * nxt).reshape(-1)
        prefixes = torch.cat(
            [prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(m)[:, None]], 1
        )
    return law


def law_pvalues(seqs: torch.Tensor, law: torch.Tensor) -> dict[str, float]:
    """Whole sequences, and each consecutive pair (x_{j-1}, x_j) from the exact law's
    marginals; ``family``: Bonferroni over them."""
    out = {"sequence": binned_chisquare(torch.bincount(encode(seqs), minlength=V**L), law, 20.0)}
    grid = law.view([V] * L)
    for j in range(L):
        if j == 0:
            pair_law = torch.zeros(V, V, dtype=torch.float64)
            pair_law[START] = grid.sum(dim=tuple(range(1, L)))
            prev = torch.full((seqs.shape[0],), START)
        else:
            other = tuple(d for d in range(L) if d not in (j - 1, j))
            pair_law = grid.sum(dim=other)
            prev = seqs[:, j - 1]
        counts = torch.bincount(prev * V + seqs[:, j], minlength=V * V)
        out[f"pair_{j}"] = binned_chisquare(counts, pair_law.flatten(), 5.0)
    out["family"] = min(1.0, len(out) * min(out.values()))
    return out


def run(params: SamplingParams, twin: str | None = None, n: int = N) -> Rollout:
    """Speculative decoding of ``n`` sequences through :func:`verify_rows` (ragged k)."""
    roll = Rollout.start(n)
    while (idx := roll.active()).numel():
        rows = idx.tolist()
        m = len(rows)
        counts = torch.randint(0, K + 1, (m,))  # [m] drafts per row, ragged
        outputs = [roll.seqs[i, : int(roll.have[i])].tolist() for i in rows]
        have = roll.have[idx]  # [m]
        done = torch.nn.functional.one_hot(roll.seqs[idx].clamp(min=0), V)  # [m, L, V]
        done = (done * (roll.seqs[idx] >= 0)[..., None]).sum(1).float()  # [m, V] output counts
        counts_now = done.clone()  # plus the drafts so far
        drafts_t = torch.zeros(m, K, dtype=torch.long)
        qs = torch.zeros(m, K, V)  # [m, K, V] what each row reports
        prev = roll.last[idx]
        for i in range(K):
            q = penalised(Q_LOGITS[prev], params, counts_now, have + i)  # [m, V]
            tok = torch.multinomial(q, 1)[:, 0]
            if twin == "q_without_drafts":
                q = penalised(Q_LOGITS[prev], params, done, have)
            qs[:, i] = q
            drafts_t[:, i] = tok
            counts_now += torch.nn.functional.one_hot(tok, V)
            prev = tok
        drafts = [drafts_t[r, : int(c)].tolist() for r, c in enumerate(counts.tolist())]
        contexts = torch.tensor(
            [
                [int(roll.last[i]), *d, *[0] * (K - len(d))]
                for i, d in zip(rows, drafts, strict=True)
            ]
        )  # [m, K + 1]
        logits = P_LOGITS[contexts]  # [m, K + 1, V] raw: verify_rows applies the penalties
        verify = [
            VerifyRow(params, drafts[r], qs[r, : len(drafts[r])], None, [START], outputs[r])
            for r in range(m)
        ]
        results = verify_rows(logits, verify)
        tokens = torch.tensor([t + [PAD_TOKEN_ID] * (K - a) for t, a in results])
        accepted = torch.tensor([a for _, a in results])
        roll.commit(idx, tokens, accepted, counts)
    return roll


def _p_without_drafts(logits, params, prompt, output, drafts=()):
    return apply_history(logits, params, prompt, output)  # wrong: drafts not counted


@pytest.fixture(scope="module")
def laws():
    return {name: exact_law(p) for name, p in [("sampled", SAMPLED), ("filtered", FILTERED)]}


@pytest.mark.parametrize("name", ["sampled", "filtered"])
def test_penalised_speculation_follows_the_exact_law(name, laws, record_property):
    params = SAMPLED if name == "sampled" else FILTERED
    torch.manual_seed(11)
    roll = run(params)
    assert_covered(roll.ends, list(range(K + 1)))  # every position, and the bonus
    pvalues = law_pvalues(roll.seqs, laws[name])
    report(f"penalties/{name}", pvalues, record_property)
    assert pvalues["family"] > ALPHA, pvalues
    # min_tokens: the banned token never appears before position 3 (2 for FILTERED).
    assert int((roll.seqs[:, : params.min_tokens] == EOS).sum()) == 0


@pytest.mark.parametrize("twin", ["p_without_drafts", "q_without_drafts"])
def test_wrong_twins_are_rejected(twin, laws, monkeypatch, record_property):
    if twin == "p_without_drafts":
        monkeypatch.setattr(specdec.verify, "apply_history", _p_without_drafts)
    torch.manual_seed(11)
    roll = run(SAMPLED, twin=twin)
    pvalues = law_pvalues(roll.seqs, laws["sampled"])
    report(f"penalties/twin_{twin}", pvalues, record_property)
    assert pvalues["family"] < ALPHA, pvalues


def test_greedy_rows_follow_the_penalised_argmax_chain():
    """Greedy rows with penalties: exactly the penalised argmax continuation."""
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.9,
        presence_penalty=1.0,
        min_tokens=3,
        all_stop_token_ids=(EOS,),
    )
    chain, prev = [], START
    for _ in range(L):
        prev = int(apply_history(P_LOGITS[prev][None], params, [START], chain)[0].argmax())
        chain.append(prev)
    plain = [int(P_LOGITS[START].argmax())]
    assert chain[:1] != plain or len(set(chain)) > 2  # the penalties matter here
    torch.manual_seed(3)
    roll = Rollout.start(200)
    while (idx := roll.active()).numel():
        rows = idx.tolist()
        drafts = [
            [int(t) for t in torch.randint(0, V, (int(torch.randint(0, K + 1, (1,))),))]
            for _ in rows
        ]
        # Half the drafts follow the chain where it applies, so acceptance happens.
        for r, i in enumerate(rows):
            have = int(roll.have[i])
            drafts[r] = [
                chain[have + j] if have + j < L and torch.rand(()) < 0.7 else t
                for j, t in enumerate(drafts[r])
            ]
        contexts = torch.tensor(
            [
                [int(roll.last[i]), *d, *[0] * (K - len(d))]
                for i, d in zip(rows, drafts, strict=True)
            ]
        )
        outputs = [roll.seqs[i, : int(roll.have[i])].tolist() for i in rows]
        verify = [
            VerifyRow(params, d, None, None, [START], o)
            for d, o in zip(drafts, outputs, strict=True)
        ]
        results = verify_rows(P_LOGITS[contexts], verify)
        tokens = torch.tensor([t + [PAD_TOKEN_ID] * (K - a) for t, a in results])
        roll.commit(
            idx,
            tokens,
            torch.tensor([a for _, a in results]),
            torch.tensor([len(d) for d in drafts]),
        )
    assert (roll.seqs == torch.tensor(chain)).all()
    assert roll.ends[K, K] > 0 and roll.ends[K, 0] > 0  # bonus and first-position rejection
