"""Statistical exactness of whole multi-round speculative sequences, with power.

Why this file exists: ``test_rejection.py`` compares only the first two output tokens
with ``k = 3``. A sampler that is wrong at a *later* draft position (say, the recovered
token after a rejection at position 2) or at the *bonus* token passes that test, because
with k = 3 those code paths never produce the first two tokens. Here we:

* decode a tiny synthetic "language model" (a Markov chain: next-token logits depend on
  the previous token) with a deliberately different draft model, ``k = 4`` drafts per
  round, for as many rounds as it takes to produce ``L = 7`` tokens, so every draft
  position 0..k-1 and the bonus token land inside the tested window (asserted);
* compare the empirical law of the whole ``L``-token sequences, and of every consecutive
  pair ``(x_{j-1}, x_j)``, with the exact target law computed by enumeration;
* show that the *same* test (same ``N``, seeds and ``ALPHA``) rejects two deliberately
  wrong samplers ("twins"), so a pass means something.

The p-values are collected in :data:`PVALUES`, attached to each test with
``record_property`` and printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdec.verify
from specdec.rejection import PAD_TOKEN_ID, RejectionOutput, rejection_sample
from specdec.sampling import SamplingParams, probs_for
from specdec.sequence import SequenceState
from specdec.verify import VerifyRow, verify_rows

V = 5  # vocabulary
K = 4  # draft tokens per round (k)
L = 7  # tested output length: > K + 1, so rounds 1 and 2 both matter
START = 0  # the prompt: a single token
N = 40_000  # sequences per vectorised (direct) run
N_VERIFY = 6_000  # sequences per verify_rows run (it loops over rows in Python)
N_SEEDED = 2_000  # one seed per sequence: per-row generators are the slowest path
ALPHA = 1e-3  # a real sampler must give p > ALPHA, a twin p < ALPHA

PVALUES: dict[str, dict[str, float]] = {}

# The synthetic model pair. Large logit scale: p(. | prev) depends strongly on prev, so
# drawing a token from the wrong position's distribution (twin b) shows. The draft is
# the target plus noise: acceptance 0.57-0.84 per context, so all-accepted rounds (bonus)
# and rejections at positions >= 2 are both common, and the residual max(0, p - q)
# differs a lot from p (twin a).
_g = torch.Generator().manual_seed(20240531)
P_LOGITS = torch.randn(V, V, generator=_g) * 2.5  # [prev, next]
Q_LOGITS = P_LOGITS + torch.randn(V, V, generator=_g) * 1.5  # [prev, next]
del _g

T1 = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=4, top_p=0.85)
GREEDY = SamplingParams(temperature=0.0)


def table(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The transformed Markov table ``[prev, next]`` that the sampler must reproduce."""
    return probs_for([params] * V, logits)  # [V, V]


# ---------------------------------------------------------------------------------------
# The exact law and the test statistic.
# ---------------------------------------------------------------------------------------


def exact_sequence_law(p_table: torch.Tensor) -> torch.Tensor:
    """P(x_0..x_{L-1} | START) for every sequence, by enumeration: ``[V**L]`` float64.

    Index ``sum_j x_j V**(L-1-j)`` (see :func:`encode`).
    """
    p = p_table.double()
    law = p[START]  # [V]: x_0
    for _ in range(L - 1):
        # [V**j] -> [V**(j+1)]: the next token depends only on the previous (last) digit.
        law = (law.view(-1, V)[..., None] * p[None]).reshape(-1)  # [V**(j-1), V, V]
    return law


def encode(seqs: torch.Tensor) -> torch.Tensor:
    """``[n, L]`` token sequences -> ``[n]`` cell indices of :func:`exact_sequence_law`."""
    weights = V ** torch.arange(L - 1, -1, -1)  # [L]
    return (seqs * weights).sum(-1)


def binned_chisquare(observed: torch.Tensor, probs: torch.Tensor, min_expected: float) -> float:
    """Pearson chi-square of counts against an exact law, rare cells merged.

    observed: [cells] counts; probs: [cells] exact probabilities.
    Cells are sorted by probability and merged greedily into bins of expected count
    >= ``min_expected`` (the binning depends only on the law, never on the data, so the
    test stays valid). A count in a zero-probability cell (a token the target can never
    produce, e.g. one that top-k/top-p removed) is conclusive: p-value 0.
    """
    observed = observed.double()
    zero = probs <= 0
    if observed[zero].sum() > 0:
        return 0.0
    n = float(observed.sum())
    expected = (probs[~zero].double() * n).numpy()
    obs = observed[~zero].numpy()
    order = np.argsort(-expected, kind="stable")
    bins_obs, bins_exp = [], []
    acc_o = acc_e = 0.0
    for i in order:
        acc_o += obs[i]
        acc_e += expected[i]
        if acc_e >= min_expected:
            bins_obs.append(acc_o)
            bins_exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0 and bins_exp:  # the leftover tail joins the last bin
        bins_obs[-1] += acc_o
        bins_exp[-1] += acc_e
    if len(bins_exp) < 2:
        return 1.0
    exp = np.asarray(bins_exp)
    exp *= n / exp.sum()  # float rounding only: scipy wants equal totals
    return float(chisquare(np.asarray(bins_obs), exp).pvalue)


def joint_law_pvalues(seqs: torch.Tensor, p_table: torch.Tensor) -> dict[str, float]:
    """p-values of ``seqs`` ([n, L]) against the Markov chain ``p_table`` from START.

    * ``sequence``: the whole ``L``-token sequence (``V**L`` cells, merged to >= 20);
    * ``pair_j``: the pair (x_{j-1}, x_j) at output position ``j`` (x_{-1} = START);
    * ``family``: Bonferroni over all of the above, the one number a test asserts on;
    * ``impossible``: how many sequences have target probability 0 (a count, not a
      p-value; any such sequence makes the p-values above 0).

    The pairs are the targeted, high-power projections (each draft position and the
    bonus lands at some j); the whole-sequence test catches dependence a wrong sampler
    could introduce across positions that pairs cannot see.
    """
    assert int((seqs < 0).sum()) == 0, "a sequence was not completed"
    out = {}
    cells = torch.bincount(encode(seqs), minlength=V**L)  # [V**L]
    law = exact_sequence_law(p_table)  # [V**L]
    out["sequence"] = binned_chisquare(cells, law, 20.0)
    p = p_table.double()
    marginal = torch.zeros(V, dtype=torch.float64)
    marginal[START] = 1.0  # law of x_{j-1}, starting with x_{-1} = START
    prev = torch.full((seqs.shape[0],), START)
    for j in range(L):
        pair_law = (marginal[:, None] * p).flatten()  # [V * V]
        pair_counts = torch.bincount(prev * V + seqs[:, j], minlength=V * V)
        out[f"pair_{j}"] = binned_chisquare(pair_counts, pair_law, 5.0)
        marginal = marginal @ p
        prev = seqs[:, j]
    out["family"] = min(1.0, len(out) * min(out.values()))
    out["impossible"] = float(cells[law <= 0].sum())
    return out


def report(name: str, pvalues: dict[str, float], record_property) -> None:
    """Keep the p-values where a reader can quote them (``-s``, junit XML, PVALUES)."""
    PVALUES[name] = pvalues
    for key, value in pvalues.items():
        record_property(key if key == "impossible" else f"p_{key}", value)
    body = ", ".join(f"{k}={v:.3g}" for k, v in pvalues.items())
    print(f"\n[joint-law] {name}: {body}")


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_summary():
    """One intra-op thread; after the module, every recorded p-value (visible with ``-s``).

    The tensors here are tiny ([N, V] with V = 5): extra threads only add spin-wait
    contention, which on a loaded 2-core machine made the module ~20x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print("\n[joint-law] summary (family = Bonferroni over sequence + pairs)")
    for name, pvalues in PVALUES.items():
        print(f"  {name:55s} family={pvalues['family']:.3g} sequence={pvalues['sequence']:.3g}")


# ---------------------------------------------------------------------------------------
# Wrong twins: the real sampler, then one output token overwritten from the wrong law.
# ---------------------------------------------------------------------------------------


def twin_recovered_from_p(
    draft_token_ids, num_draft_tokens, target_probs, draft_probs, is_greedy, generators, *a, **kw
) -> RejectionOutput:
    """Wrong: a rejection at draft position >= 2 recovers from ``p`` not ``norm(p - q)+``."""
    out = rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        target_probs,
        draft_probs,
        is_greedy,
        generators,
        *a,
        **kw,
    )
    rows = ((~out.bonus) & (out.num_accepted >= 2) & ~is_greedy).nonzero()[:, 0]  # [r]
    if rows.numel():
        pos = out.num_accepted[rows]  # [r]: the rejected position
        redraw = torch.multinomial(target_probs[rows, pos], 1)[:, 0]
        out.output_token_ids[rows, pos] = redraw
    return out


def twin_bonus_from_p_k(
    draft_token_ids, num_draft_tokens, target_probs, draft_probs, is_greedy, generators, *a, **kw
) -> RejectionOutput:
    """Wrong: the bonus token is drawn from ``p_k`` (last draft's position), not ``p_{k+1}``."""
    out = rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        target_probs,
        draft_probs,
        is_greedy,
        generators,
        *a,
        **kw,
    )
    counts = num_draft_tokens.to(out.num_accepted.device)
    rows = (out.bonus & (counts >= 1) & ~is_greedy).nonzero()[:, 0]  # [r]
    if rows.numel():
        pos = counts[rows]  # [r]: the bonus slot; p_k is the slot before it
        redraw = torch.multinomial(target_probs[rows, pos - 1], 1)[:, 0]
        out.output_token_ids[rows, pos] = redraw
    return out


SAMPLERS: dict[str, Callable[..., RejectionOutput]] = {
    "real": rejection_sample,
    "twin_recovered_from_p": twin_recovered_from_p,
    "twin_bonus_from_p_k": twin_bonus_from_p_k,
}


# ---------------------------------------------------------------------------------------
# Decoding loops: many independent sequences as one batch, rows drop out at L tokens.
# ---------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """State of ``n`` sequences decoded in lock-step rounds."""

    seqs: torch.Tensor  # [n, L] committed tokens, -1 where not yet produced
    have: torch.Tensor  # [n] tokens committed so far
    last: torch.Tensor  # [n] newest committed token (START before the first round)
    ends: torch.Tensor  # [K + 1, K + 1] rounds by (drafted, accepted), last token < L

    @classmethod
    def start(cls, n: int) -> Rollout:
        return cls(
            seqs=torch.full((n, L), -1, dtype=torch.long),
            have=torch.zeros(n, dtype=torch.long),
            last=torch.full((n,), START, dtype=torch.long),
            ends=torch.zeros(K + 1, K + 1, dtype=torch.long),
        )

    def active(self) -> torch.Tensor:
        return (self.have < L).nonzero()[:, 0]  # [m]

    def commit(self, idx, tokens, accepted, counts) -> None:
        """Append one round's tokens ([m, K + 1], -1 padded) to rows ``idx`` ([m]).

        ``ends`` counts a round only if its last (recovered or bonus) token falls in the
        tested window, so coverage asserts talk about tokens the test actually sees.
        """
        base = self.have[idx]  # [m]
        for j in range(K + 1):
            pos = base + j
            ok = (j <= accepted) & (pos < L)
            self.seqs[idx[ok], pos[ok]] = tokens[ok, j]
        inside = base + accepted < L
        self.ends.index_put_(
            (counts[inside], accepted[inside]),
            torch.ones(int(inside.sum()), dtype=torch.long),
            accumulate=True,
        )
        self.last[idx] = tokens[torch.arange(idx.numel()), accepted]
        self.have[idx] = base + accepted + 1


def draw_counts(m: int, ragged: bool) -> torch.Tensor:
    """Drafts per row this round: all K, or ragged 0..K (independent of everything else)."""
    if ragged:
        return torch.randint(0, K + 1, (m,))  # [m]
    return torch.full((m,), K, dtype=torch.long)


def run_direct(
    p_table: torch.Tensor,
    q_table: torch.Tensor,
    sampler: Callable[..., RejectionOutput] = rejection_sample,
    *,
    proposal: str = "probs",
    ragged: bool = False,
    greedy: torch.Tensor | None = None,
    n: int = N,
) -> Rollout:
    """Speculative decoding with probabilities computed from the tables, all vectorised.

    Positions at or beyond a row's draft count get token -1 and q = 0: the sampler must
    ignore them (as its docstring promises). ``greedy`` ([n] bool) marks rows that are
    verified by argmax against the one-hot target (as ``probs_for`` gives at T = 0); they
    draft the target's argmax with probability 3/4, else a uniform token, with q = δ_x.
    """
    roll = Rollout.start(n)
    greedy = torch.zeros(n, dtype=torch.bool) if greedy is None else greedy
    p_greedy = table(P_LOGITS, GREEDY)  # [V, V] one-hot at each row's argmax
    while (idx := roll.active()).numel():
        m = idx.numel()
        g = greedy[idx]  # [m]
        counts = draw_counts(m, ragged)  # [m]
        drafts = torch.full((m, K), PAD_TOKEN_ID, dtype=torch.long)  # [m, K]
        qs = torch.zeros(m, K, V)  # [m, K, V]
        prev = roll.last[idx]  # [m]
        for i in range(K):
            if proposal == "probs":
                q = q_table[prev]  # [m, V]
                tok = torch.multinomial(q, 1)[:, 0]
            elif proposal == "point_mass":  # a deterministic proposer: q = δ_x
                q = None
                tok = q_table[prev].argmax(-1)
            else:  # a random backup: uniform proposal
                q = None
                tok = torch.randint(0, V, (m,))
            guess = torch.where(
                torch.rand(m) < 0.75, p_greedy[prev].argmax(-1), torch.randint(0, V, (m,))
            )
            tok = torch.where(g, guess, tok)
            if q is not None:
                q = torch.where(g[:, None], torch.nn.functional.one_hot(tok, V).float(), q)
            valid = i < counts  # [m]
            drafts[valid, i] = tok[valid]
            if q is not None:
                qs[valid, i] = q[valid]
            prev = tok
        contexts = torch.cat([roll.last[idx, None], drafts.clamp(min=0)], 1)  # [m, K + 1]
        p = torch.where(g[:, None, None], p_greedy[contexts], p_table[contexts])
        out = sampler(
            drafts,
            counts,
            p,  # [m, K + 1, V]
            qs if proposal == "probs" else None,
            g,
            [None] * m,
            proposal,
        )
        roll.commit(idx, out.output_token_ids, out.num_accepted, counts)
    return roll


def run_verify(
    params: list[SamplingParams],
    *,
    ragged: bool = False,
    seeded: bool = False,
    point_mass: bool = False,
) -> Rollout:
    """Speculative decoding through :func:`verify_rows`, from raw logits (the engine path).

    With ``point_mass`` every row drafts deterministically (the argmax of the draft's
    logits, as an n-gram lookup is a function of the context) and is verified with
    ``VerifyRow.point_mass``: q = δ at each draft, no q sent.

    params: [n] per-row sampling settings; greedy rows draft the target's argmax with
    probability 3/4 (else a uniform token) so they accept and reject at every position.
    With ``seeded`` every sampled row's draws come from its request's generators, exactly
    as the engine makes them (:class:`SequenceState`: one draft stream per position, one
    verify stream per round).
    """
    n = len(params)
    roll = Rollout.start(n)
    states = [SequenceState(i, [START], sp) for i, sp in enumerate(params)] if seeded else None
    greedy_all = torch.tensor([sp.is_greedy for sp in params])  # [n]
    while (idx := roll.active()).numel():
        m = idx.numel()
        rows = idx.tolist()
        prm = [params[i] for i in rows]
        have = roll.have[idx].tolist()
        greedy = greedy_all[idx]  # [m]
        counts = draw_counts(m, ragged)  # [m]
        count_list = counts.tolist()
        drafts = torch.full((m, K), PAD_TOKEN_ID, dtype=torch.long)  # [m, K]
        qs = torch.zeros(m, K, V)  # [m, K, V]
        prev = roll.last[idx]  # [m]
        for i in range(K):
            q = probs_for(prm, Q_LOGITS[prev])  # [m, V], the same transform as p
            tok = Q_LOGITS[prev].argmax(-1) if point_mass else torch.multinomial(q, 1)[:, 0]
            if states is not None:  # seeded rows: the request's stream for this position
                for r, row in enumerate(rows):
                    if i < count_list[r] and not prm[r].is_greedy:
                        gen = states[row].draft_generator_at(1 + have[r] + i)
                        tok[r] = torch.multinomial(q[r], 1, generator=gen)[0]
            # Greedy rows: mostly the target's argmax, sometimes a random token.
            guess = torch.where(
                torch.rand(m) < 0.75, P_LOGITS[prev].argmax(-1), torch.randint(0, V, (m,))
            )
            tok = torch.where(greedy, guess, tok)
            valid = i < counts  # [m]
            drafts[valid, i] = tok[valid]
            qs[valid, i] = q[valid]
            prev = tok
        contexts = torch.cat([roll.last[idx, None], drafts.clamp(min=0)], 1)  # [m, K + 1]
        logits = P_LOGITS[contexts]  # [m, K + 1, V]
        beyond = torch.arange(K + 1)[None, :] > counts[:, None]  # [m, K + 1] unused slots
        logits[beyond] = torch.randn(int(beyond.sum()), V) * 5  # must not matter
        draft_list = drafts.tolist()
        verify = [
            VerifyRow(
                sp,
                draft_list[r][:c],
                None if sp.is_greedy or point_mass else qs[r, :c],
                None if states is None else states[row].verify_generator_at(1 + have[r]),
                point_mass=point_mass,
            )
            for r, (row, sp, c) in enumerate(zip(rows, prm, count_list, strict=True))
        ]
        results = verify_rows(logits, verify)
        padded, accepted = [], []
        for (toks, a), c in zip(results, count_list, strict=True):
            assert len(toks) == a + 1 and a <= c, (toks, a, c)
            padded.append(toks + [PAD_TOKEN_ID] * (K - a))
            accepted.append(a)
        roll.commit(idx, torch.tensor(padded), torch.tensor(accepted), counts)
    return roll


def greedy_chain() -> list[int]:
    """The target's argmax continuation of START: what every greedy row must output."""
    out, prev = [], START
    for _ in range(L):
        prev = int(P_LOGITS[prev].argmax())
        out.append(prev)
    return out


def assert_covered(ends: torch.Tensor, draft_counts: list[int]) -> None:
    """Every (drafted c, accepted a <= c) outcome ended some round inside the window.

    a < c: a rejection at draft position a (recovered token); a == c: the bonus token.
    """
    missing = [(c, a) for c in draft_counts for a in range(c + 1) if ends[c, a] == 0]
    assert not missing, f"never exercised (drafted, accepted): {missing}\n{ends}"


# ---------------------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------------------


def test_tables_make_a_hard_case():
    """The model pair is neither trivial nor hopeless, so rounds end at every position."""
    p, q = table(P_LOGITS, T1), table(Q_LOGITS, T1)
    acceptance = torch.minimum(p, q).sum(-1)  # [V]: 1 - TV(p, q) per context
    assert bool((acceptance > 0.4).all()) and bool((acceptance < 0.9).all()), acceptance
    f = table(P_LOGITS, FILTERED)
    assert bool(((f == 0).sum(-1) >= 1).all()), "top-k/top-p must cut every row"
    k_only = table(P_LOGITS, SamplingParams(temperature=0.8, top_k=4))
    assert bool(((f == 0).sum(-1) > (k_only == 0).sum(-1)).any()), "top-p must cut too"


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_joint_law_direct_and_twins(sampler, record_property):
    """The whole-sequence test passes the real sampler and rejects both wrong twins.

    Same N, same seed, same ALPHA for all three: only the sampler differs.
    """
    torch.manual_seed(1)
    p_table, q_table = table(P_LOGITS, T1), table(Q_LOGITS, T1)
    roll = run_direct(p_table, q_table, SAMPLERS[sampler])
    assert_covered(roll.ends, [K])
    pvalues = joint_law_pvalues(roll.seqs, p_table)
    report(f"direct T=1 k={K} sampler={sampler}", pvalues, record_property)
    if sampler == "real":
        assert pvalues["family"] > ALPHA, pvalues
    else:
        assert pvalues["family"] < ALPHA, f"the test has no power against {sampler}: {pvalues}"


@pytest.mark.parametrize("proposal", ["point_mass", "uniform"])
def test_joint_law_other_proposals(proposal, record_property):
    """Deterministic (q = δ_x) and uniform proposals are exact too, over whole sequences."""
    torch.manual_seed(2)
    p_table, q_table = table(P_LOGITS, T1), table(Q_LOGITS, T1)
    roll = run_direct(p_table, q_table, proposal=proposal)
    assert_covered(roll.ends, [K])
    pvalues = joint_law_pvalues(roll.seqs, p_table)
    report(f"direct T=1 k={K} proposal={proposal}", pvalues, record_property)
    assert pvalues["family"] > ALPHA, pvalues


@pytest.mark.parametrize("path", ["direct", "verify_rows"])
def test_joint_law_top_k_top_p(path, record_property):
    """With temperature, top-k and top-p the target is the *transformed* chain.

    p and q go through the same transform (probs_for), never raw softmax.
    """
    torch.manual_seed(3)
    p_table = table(P_LOGITS, FILTERED)
    if path == "direct":
        roll = run_direct(p_table, table(Q_LOGITS, FILTERED))
    else:
        roll = run_verify([FILTERED] * N_VERIFY)
    assert_covered(roll.ends, [K])
    pvalues = joint_law_pvalues(roll.seqs, p_table)
    report(f"{path} T=0.8 top_k=4 top_p=0.85", pvalues, record_property)
    assert pvalues["family"] > ALPHA, pvalues


@pytest.mark.parametrize("path", ["direct", "verify_rows"])
def test_joint_law_ragged_draft_counts(path, record_property):
    """Rows of one batch draft 0..K tokens at T=1 (0 = a plain decode step).

    Unused draft slots hold -1, q = 0 and (verify_rows) random logits: all ignored.
    """
    torch.manual_seed(4)
    p_table = table(P_LOGITS, T1)
    if path == "direct":
        roll = run_direct(p_table, table(Q_LOGITS, T1), ragged=True)
    else:
        roll = run_verify([T1] * N_VERIFY, ragged=True)
    assert_covered(roll.ends, list(range(K + 1)))
    pvalues = joint_law_pvalues(roll.seqs, p_table)
    report(f"{path} T=1 ragged counts 0..{K}", pvalues, record_property)
    assert pvalues["family"] > ALPHA, pvalues


def test_rejection_sample_mixed_greedy_and_sampled(record_property):
    """rejection_sample itself on a batch of greedy and T=1 rows with ragged counts.

    Greedy rows (is_greedy, one-hot target) must reproduce the argmax chain exactly;
    sampled rows beside them must still follow the target chain.
    """
    torch.manual_seed(9)
    greedy = torch.arange(N) % 2 == 0  # [N]
    p_table = table(P_LOGITS, T1)
    roll = run_direct(p_table, table(Q_LOGITS, T1), ragged=True, greedy=greedy)
    assert bool((roll.seqs[greedy] == torch.tensor(greedy_chain())).all()), "greedy rows differ"
    assert_covered(roll.ends, list(range(K + 1)))
    pvalues = joint_law_pvalues(roll.seqs[~greedy], p_table)
    report("direct mixed batch (greedy + T=1), ragged, T=1 rows", pvalues, record_property)
    assert pvalues["family"] > ALPHA, pvalues


def assert_groups(roll, group, kinds, label, sampler, record_property) -> None:
    """Each sampled kind of a batch against its own transformed chain: all pass with the
    real sampler, the batch's weakest group is rejected with a wrong twin."""
    family = {}
    for g, (name, sp) in enumerate(kinds.items()):
        if sp.is_greedy:
            continue
        pvalues = joint_law_pvalues(roll.seqs[group == g], table(P_LOGITS, sp))
        report(f"{label}, {name} rows, sampler={sampler}", pvalues, record_property)
        family[name] = pvalues["family"]
    if sampler == "real":
        assert min(family.values()) > ALPHA, family
    else:
        assert min(family.values()) < ALPHA, f"no power against {sampler}: {family}"


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_verify_rows_mixed_greedy_and_sampled(sampler, monkeypatch, record_property):
    """One batch of greedy, T=1 and filtered (top-k/top-p) rows through verify_rows.

    Greedy rows must reproduce the target's argmax chain exactly (whatever they drafted);
    each sampled group must follow its own transformed chain. The twins are patched in
    under verify_rows to show this logits-level test has power as well.
    """
    monkeypatch.setattr(specdec.verify, "rejection_sample", SAMPLERS[sampler])
    torch.manual_seed(5)
    kinds = {"greedy": GREEDY, "T=1": T1, "filtered": FILTERED}
    params = [sp for _, sp in zip(range(N_VERIFY), itertools.cycle(kinds.values()))]
    roll = run_verify(params)
    group = torch.arange(len(params)) % len(kinds)  # [n]: index into kinds

    greedy_rows = roll.seqs[group == 0]  # [n/3, L]
    assert bool((greedy_rows == torch.tensor(greedy_chain())).all()), "greedy rows differ"
    assert_covered(roll.ends, [K])

    assert_groups(roll, group, kinds, "verify_rows mixed batch", sampler, record_property)


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_verify_rows_point_mass_drafts(sampler, monkeypatch, record_property):
    """Deterministic drafts (the n-gram proposer's) through verify_rows with
    ``point_mass``: T=1 and filtered rows follow their chains; the twins, patched under
    verify_rows, are rejected at the same size and ALPHA."""
    monkeypatch.setattr(specdec.verify, "rejection_sample", SAMPLERS[sampler])
    torch.manual_seed(6)
    kinds = {"T=1": T1, "filtered": FILTERED}
    params = [sp for _, sp in zip(range(N_VERIFY), itertools.cycle(kinds.values()))]
    roll = run_verify(params, point_mass=True)
    group = torch.arange(len(params)) % len(kinds)  # [n]: index into kinds
    assert_covered(roll.ends, [K])
    assert_groups(roll, group, kinds, "verify_rows point mass", sampler, record_property)


def test_seeded_rows_reproducible():
    """Same seed => same whole sequence, whatever the rest of the batch is.

    Run alone, then reversed and interleaved with unseeded and greedy companions, with
    the global RNG in a different state: a seeded row's draws come only from its own
    request's generators, so its sequence cannot change.
    """
    seeds = [SamplingParams(seed=s) for s in range(40)]
    torch.manual_seed(6)
    alone = run_verify(seeds, seeded=True).seqs  # [40, L]
    torch.manual_seed(7)
    mixed = [sp for sp in reversed(seeds) for sp in (sp, T1, GREEDY)]
    together = run_verify(mixed, seeded=True, ragged=False).seqs[::3].flip(0)
    assert torch.equal(alone, together)
    assert len({tuple(s) for s in alone.tolist()}) > 20, "seeds must give different sequences"


def test_seeded_rows_joint_law(record_property):
    """Across seeds 0..N_SEEDED-1 the seeded sequences follow the target chain.

    Reproducibility must not cost exactness: the per-position draft streams and the
    per-round verify streams must not reuse randomness that decided a committed token.
    """
    torch.manual_seed(8)
    roll = run_verify([SamplingParams(seed=s) for s in range(N_SEEDED)], seeded=True)
    assert_covered(roll.ends, [K])
    pvalues = joint_law_pvalues(roll.seqs, table(P_LOGITS, T1))
    report("verify_rows seeded T=1 (one seed per row)", pvalues, record_property)
    assert pvalues["family"] > ALPHA, pvalues
