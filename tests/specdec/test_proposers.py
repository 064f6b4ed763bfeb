import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.proposers import DraftModelProposer, NgramProposer, ngram_propose
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.speculation_cache import SpeculativeDrafter


@pytest.mark.parametrize(
    ("tokens", "k", "n_max", "expected"),
    [
        ([1, 2, 3, 9, 9, 1, 2, 3], 2, 3, [9, 9]),  # 3-gram match, continuation
        ([1, 2, 3, 4, 5, 1, 2, 3], 10, 3, [4, 5, 1, 2, 3]),  # capped by what exists
        ([1, 2, 7, 1, 2, 8, 1, 2], 1, 2, [8]),  # latest earlier occurrence wins
        ([4, 5, 6, 7], 3, 3, []),  # nothing repeats
        ([1, 2, 3, 5, 2, 3, 6, 3], 2, 3, [6, 3]),  # falls back to 1-gram (latest '3')
        ([7, 7, 7, 7], 3, 2, [7]),  # overlapping match: only one token follows it
        ([5], 3, 3, []),  # too short
    ],
)
def test_ngram_table(tokens, k, n_max, expected):
    assert ngram_propose(tokens, k, n_max=n_max) == expected


def _scan(token_ids, k, n_max, n_min):
    """The definition, scanned in Python: the latest earlier match of the longest suffix."""
    length = len(token_ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == token_ids[length - n :]:
                return token_ids[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=40),
    st.integers(0, 6),
    st.integers(1, 5),
    st.integers(1, 5),
)
def test_ngram_lookup_equals_the_scan(tokens, k, n_max, n_min):
    """The vectorised lookup proposes what the definition says, on short alphabets (many
    overlapping matches) and every k and n range, empty ones included."""
    expected = _scan(tokens, k, n_max, n_min) if k > 0 else []
    assert ngram_propose(tokens, k, n_max=n_max, n_min=n_min) == expected


def test_ngram_respects_n_min():
    assert ngram_propose([1, 2, 3, 5, 2, 3, 6, 3], 2, n_max=3, n_min=2) == []


def test_ngram_proposer_batches_ragged_rows():
    seqs = [
        SequenceState("a", [1, 2, 3, 9, 1, 2], SamplingParams()),
        SequenceState("b", [4, 5, 6], SamplingParams()),
    ]
    prop = NgramProposer(n_max=2).propose(seqs, 3)
    assert prop.kind == "point_mass" and prop.draft_probs is None
    assert prop.num_draft_tokens.tolist() == [3, 0]
    assert prop.draft_token_ids[0].tolist() == [3, 9, 1]


def test_ngram_proposer_rejects_bad_n():
    with pytest.raises(ValueError, match="n_min"):
        NgramProposer(n_max=1, n_min=2)


def test_speculation_never_forks_past_the_draft_runner(tiny_draft):
    """A budget larger than the free KV slots prepares as many branches as fit."""

    drafter = SpeculativeDrafter(DraftModelProposer(ModelRunner(tiny_draft, max_num_seqs=6)))
    params = SamplingParams(temperature=0.0, max_tokens=50)
    for i in range(2):
        drafter.add(f"s{i}", [5 + i, 9, 14], params)
    drafter.propose(["s0", "s1"], [3, 3])
    branches = drafter.speculate(["s0", "s1"], budget=10)
    assert len(branches) == 4 and drafter.proposer.runner.num_seqs == 6


def test_a_stopped_speculation_keeps_its_greedy_branches_drafts_so_far(tiny_draft):
    """The real outcome arriving while branches are drafted stops them before the next
    step: each greedy branch keeps the drafts made by then (not complete: a draft worker
    sends them only when hit; cut: more would follow), a sampled one is freed (fewer
    drafts would move a seeded request's round boundaries), and the branch that guessed
    the outcome serves its drafts with the rest drafted on from its last: the drafts that
    drafting afresh from the same tokens gives, all k of them."""
    runner = ModelRunner(tiny_draft, max_num_seqs=40)
    drafter = SpeculativeDrafter(DraftModelProposer(runner))
    greedy = SamplingParams(temperature=0.0, max_tokens=50)
    drafter.add("g", [5, 9, 14], greedy)
    drafter.add("s", [6, 9, 14], SamplingParams(temperature=1.0, seed=3, max_tokens=50))
    drafter.propose(["g", "s"], [4, 4])
    checks = []

    def stop_after_two_steps() -> bool:  # (asked before each step)
        checks.append(None)
        return len(checks) > 2

    branches = drafter.speculate(["g", "s"], budget=32, should_stop=stop_after_two_steps)
    assert len(checks) == 3 and branches
    assert {br.seq_id for br in branches} == {"g"}  # the sampled row had branches too: freed
    assert all(not br.drafts.complete and len(br.drafts.tokens) == 2 for br in branches)
    assert all(br.drafts.cut for br in branches)
    assert runner.num_seqs == 2 + len(branches)
    hit = branches[-1]
    drafter.commit("g", list(hit.guess))
    passes = _count_passes(runner)
    got = drafter.propose(["g"], [4])[0]
    assert got.speculative and not got.complete and not got.cut
    assert got.tokens[:2] == hit.drafts.tokens and len(got.tokens) == 4
    assert len(passes) == 2  # the two drafts still to make, from the branch's last
    assert got.top_ids.shape[0] == got.top_probs.shape[0] == 4
    assert runner.num_seqs == 2  # the other branches of g are gone
    fresh = SpeculativeDrafter(DraftModelProposer(ModelRunner(tiny_draft, max_num_seqs=1)))
    fresh.add("g", drafter.seqs["g"].token_ids, greedy)
    again = fresh.propose(["g"], [4])[0]
    assert again.tokens == got.tokens
    torch.testing.assert_close(again.top_probs, got.top_probs)
    # served with fewer drafts than it holds: a prefix, nothing more to draft
    drafter.commit("g", [got.tokens[0], 7])
    drafter.propose(["g"], [3])
    assert all(br.drafts.complete for br in drafter.speculate(["g"], budget=4))


def _count_passes(runner: ModelRunner) -> list:
    """A list that grows by one at each forward pass ``runner`` runs from now on."""
    passes: list = []
    forward = runner.forward_padded

    def counted(*args, **kwargs):
        passes.append(None)
        return forward(*args, **kwargs)

    runner.forward_padded = counted
    return passes


def _speculation_cut_at_step_three(tiny_draft, min_confidence: float):
    """A greedy sequence's branches for k = 6, stopped by the outcome before step 4."""
    runner = ModelRunner(tiny_draft, max_num_seqs=40)
    drafter = SpeculativeDrafter(DraftModelProposer(runner, min_confidence=min_confidence))
    drafter.add("g", [5, 9, 14], SamplingParams(temperature=0.0, max_tokens=50))
    drafter.propose(["g"], [6])
    checks = []

    def stop_after_three_steps() -> bool:
        checks.append(None)
        return len(checks) > 3

    branches = drafter.speculate(["g"], budget=32, should_stop=stop_after_three_steps)
    return runner, drafter, branches


def _fresh_drafts(tiny_draft, token_ids: list[int], k: int, min_confidence: float) -> list:
    """What drafting afresh from ``token_ids`` proposes: the reference for branches."""
    runner = ModelRunner(tiny_draft, max_num_seqs=1)
    drafter = SpeculativeDrafter(DraftModelProposer(runner, min_confidence=min_confidence))
    drafter.add("g", token_ids, SamplingParams(temperature=0.0, max_tokens=50))
    return drafter.propose(["g"], [k])[0].tokens


@pytest.mark.parametrize("cut", [True, False])
def test_only_a_branch_the_outcome_stopped_is_drafted_on(tiny_draft, cut):
    """Branches stopped by the outcome after three steps, with a confidence stop that ends
    some before or at the third: a branch is cut exactly where drafting afresh from its
    tokens gives more drafts than it holds (one that stopped at its own confidence stop
    on the third step is not); a hit on a cut one is drafted on, a hit on another is
    served as it is (no pass). Either way the hit serves what drafting afresh gives."""
    confidence = 0.1  # (the tiny draft's: some branches stop at 1, 2 or 3 drafts, some not)
    runner, drafter, branches = _speculation_cut_at_step_three(tiny_draft, confidence)
    fresh = {
        br.guess: _fresh_drafts(tiny_draft, br.state.token_ids, 6, confidence) for br in branches
    }
    for br in branches:
        assert br.drafts.tokens == fresh[br.guess][: len(br.drafts.tokens)]
        assert br.drafts.cut == (len(fresh[br.guess]) > len(br.drafts.tokens))
    assert {br.drafts.cut for br in branches} == {True, False}
    # a branch that ended at its own stop on the step the outcome stopped the others at
    assert any(len(br.drafts.tokens) == 3 and not br.drafts.cut for br in branches)
    hit = next(br for br in branches if br.drafts.cut == cut)
    drafter.commit("g", list(hit.guess))
    passes = _count_passes(runner)
    got = drafter.propose(["g"], [6])[0]
    assert got.speculative and got.tokens == fresh[hit.guess]
    assert bool(passes) == cut


def test_a_cut_branch_asked_for_no_more_drafts_than_it_holds_is_served_without_a_pass(
    tiny_draft,
):
    """The core may ask for fewer drafts than a branch was prepared with (max_tokens, the
    length policy): a cut branch holding as many as asked is served as it is."""
    _runner, drafter, branches = _speculation_cut_at_step_three(tiny_draft, 0.0)
    assert all(br.drafts.cut and len(br.drafts.tokens) == 3 for br in branches)
    hit = branches[0]
    drafter.commit("g", list(hit.guess))
    calls = []
    propose = drafter.proposer.propose
    drafter.proposer.propose = lambda *a, **kw: calls.append(None) or propose(*a, **kw)
    got = drafter.propose(["g"], [3])[0]
    assert got.tokens == hit.drafts.tokens and not calls  # (no proposal, no read)


def test_new_weights_drop_the_branches_drafted_by_the_old(tiny_draft):
    """Branches prepared ahead were drafted by the old weights: a swap frees them (and
    their KV slots); the sequences stay, and the next round drafts them afresh."""
    drafter = SpeculativeDrafter(DraftModelProposer(ModelRunner(tiny_draft, max_num_seqs=6)))
    params = SamplingParams(temperature=0.0, max_tokens=50)
    for i in range(2):
        drafter.add(f"s{i}", [5 + i, 9, 14], params)
    drafter.propose(["s0", "s1"], [3, 3])
    assert drafter.speculate(["s0", "s1"], budget=4)
    drafter.load_weights(drafter.proposer.runner.model.state_dict())
    assert drafter.proposer.runner.num_seqs == 2 and set(drafter.seqs) == {"s0", "s1"}
    for sid in ("s0", "s1"):
        drafter.commit(sid, [7, 8])
    drafts = drafter.propose(["s0", "s1"], [3, 3])
    assert all(len(d.tokens) == 3 and not d.speculative for d in drafts)


def test_drafts_stay_within_the_shared_ids_on_every_path(tiny_target, tmp_path):
    """A draft with padding rows that are often its argmax, limited below both models'
    row counts: drafts, sampled drafts, top-m guesses and bonus candidates all stay below
    the limit; a committed id the draft has no embedding row for is fed as 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows + 8, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[rows : rows + 4] = 10 * head[:4]
        head[rows + 4 :] = -10 * head[:4]
    model.save_pretrained(tmp_path)
    limit = rows - 6
    unlimited = DraftModelProposer(ModelRunner(str(tmp_path)))
    proposer = DraftModelProposer(ModelRunner(str(tmp_path)), vocab_limit=limit)
    seqs = [
        SequenceState("g", [5, 9, 14], SamplingParams(temperature=0.0, max_tokens=40)),
        SequenceState("s", [7, 3, 2], SamplingParams(temperature=1.0, max_tokens=40, seed=1)),
        SequenceState("far", [5, rows + 50, 9], SamplingParams(temperature=0.0, max_tokens=40)),
    ]
    wide = unlimited.propose(seqs[:2], 6, top_m=4)
    assert int(wide.draft_token_ids.max()) >= limit  # the power: unlimited, padding wins
    prop = proposer.propose(seqs, 6, top_m=4)
    assert int(prop.draft_token_ids.max()) < limit and int(prop.top_token_ids.max()) < limit
    assert prop.draft_probs.shape[-1] == limit and prop.num_draft_tokens.tolist() == [6, 6, 6]
    bonus_ids, _ = proposer.extend(seqs, 4)
    assert int(bonus_ids.max()) < limit


def test_q_is_kept_for_sampled_rows_only(tiny_draft):
    """A batch mixing greedy and sampled rows: the draft's q buffer has the sampled rows'
    distributions and nothing for greedy rows (no [batch, k, vocab] for rows that need none)."""
    proposer = DraftModelProposer(ModelRunner(tiny_draft, max_num_seqs=4))
    seqs = [
        SequenceState("g0", [5, 9, 14], SamplingParams(temperature=0.0)),
        SequenceState("s0", [5, 9, 14], SamplingParams(temperature=1.0, seed=1)),
        SequenceState("g1", [7, 8], SamplingParams(temperature=0.0)),
        SequenceState("s1", [7, 8], SamplingParams(temperature=0.7, top_k=5, seed=2)),
    ]
    prop = proposer.propose(seqs, 3)
    assert prop.probs_rows == (1, 3) and prop.draft_probs.shape[:2] == (2, 3)
    assert prop.q(0) is None and prop.q(2) is None
    for row in (1, 3):
        q = prop.q(row).float()  # [k, vocab]
        assert torch.allclose(q.sum(-1), torch.ones(3), atol=1e-2)
        drafted = prop.draft_token_ids[row]
        assert bool((q.gather(-1, drafted[:, None]) > 0).all())  # drawn from its own q
    assert int((prop.q(3).float() > 0).sum(-1).max()) <= 5  # top-k truncated
    assert proposer.propose(seqs[::2], 3).draft_probs is None  # all greedy: no buffer


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stopping_early_drafts_the_same_in_fewer_passes(tiny_draft, temperature):
    """With ``stop_early`` the draft ends once the confidence stop has ended every row:
    the same drafts, counts and q as running all k steps; only the passes differ. Later
    rounds feed what the shorter run did not cache in one pass with the new tokens (a pass
    of more queries: q equal up to rounding, the same tokens on these seeds)."""
    outs = {}
    for stop_early in (False, True):
        runner = ModelRunner(tiny_draft, max_num_seqs=4)
        passes = []
        forward = runner.forward_padded

        def counted(*args, _forward=forward, _passes=passes, **kwargs):
            _passes.append(1)
            return _forward(*args, **kwargs)

        runner.forward_padded = counted
        # A threshold near 1 stops every row of a random draft within its first steps.
        proposer = DraftModelProposer(runner, min_confidence=0.9, stop_early=stop_early)
        params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2)]
        seqs = [
            SequenceState("a", [5, 9, 14, 3], params[0]),
            SequenceState("b", [7, 8], params[1]),
        ]
        rounds = []
        for _ in range(3):
            prop = proposer.propose(seqs, 8)
            counts = prop.host_num_draft_tokens
            drafts = [d[:n] for d, n in zip(prop.host_draft_token_ids, counts, strict=True)]
            q = [None if prop.q(r) is None else prop.q(r)[: counts[r]] for r in range(2)]
            rounds.append((counts, drafts, q))
            for seq, d in zip(seqs, drafts, strict=True):
                seq.output_token_ids.extend([*d[:1], 11])  # one accepted, then a bonus
        outs[stop_early] = (rounds, len(passes))
    (full, full_passes), (early, early_passes) = outs[False], outs[True]
    assert full_passes == 3 * 8 and early_passes < full_passes
    for i, ((c0, d0, q0), (c1, d1, q1)) in enumerate(zip(full, early, strict=True)):
        assert c0 == c1 and d0 == d1 and max(c0) < 8
        for a, b in zip(q0, q1, strict=True):
            assert (a is None) == (b is None) == (temperature == 0.0)
            if a is not None:
                assert torch.equal(a, b) if i == 0 else torch.allclose(a, b, atol=1e-3)


def _drafted(proposer, seqs, rounds: int) -> None:
    """A few rounds: each row keeps two drafts, then a bonus token."""
    for _ in range(rounds):
        prop = proposer.propose(seqs, 4, 4)
        for seq, d in zip(seqs, prop.host_draft_token_ids, strict=True):
            seq.output_token_ids.extend([*d[:2], 11])


def test_new_weights_draft_as_a_draft_that_only_had_them(tiny_draft, tiny_target):
    """After ``load_weights`` a sequence's drafts and distributions are those of a draft
    that only ever had the new weights: its cache is rebuilt, nothing the old weights
    computed remains. The wrong twin (new weights, old cache kept) differs, so the check
    would see a missing rebuild."""
    new_weights = ModelRunner(tiny_target).model.state_dict()  # same shapes, other values

    def after_swap(rebuild: bool):
        proposer = DraftModelProposer(ModelRunner(tiny_draft, max_num_seqs=4))
        seqs = [
            SequenceState("a", [5, 9, 14, 3], SamplingParams(temperature=0.0)),
            SequenceState("b", [7, 8], SamplingParams(temperature=0.0)),
        ]
        _drafted(proposer, seqs, 2)
        if rebuild:
            proposer.load_weights(new_weights)
        else:
            proposer.runner.load_weights(new_weights)
        return proposer.propose(seqs, 4, 4), seqs, proposer

    swapped, seqs, proposer = after_swap(rebuild=True)
    assert proposer.weights_version == 1
    fresh = DraftModelProposer(ModelRunner(tiny_target, max_num_seqs=4)).propose(seqs, 4, 4)
    assert swapped.host_draft_token_ids == fresh.host_draft_token_ids
    torch.testing.assert_close(swapped.top_probs, fresh.top_probs, atol=1e-5, rtol=1e-4)
    stale, _, _ = after_swap(rebuild=False)
    assert not torch.allclose(stale.top_probs, fresh.top_probs, atol=1e-3)


def test_weights_that_do_not_fit_are_refused_untouched(tiny_draft):
    runner = ModelRunner(tiny_draft, max_num_seqs=2)
    good = {k: v.clone() for k, v in runner.model.state_dict().items()}
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    name = "model.layers.0.mlp.up_proj.weight"
    missing = {k: v for k, v in good.items() if k != name}
    wrong = {**good, name: torch.zeros(3, 3)}
    extra = {**{k: v + 1 for k, v in good.items()}, "model.extra.weight": torch.zeros(1)}
    nan = {**good, name: torch.full_like(good[name], float("nan"))}
    array = {**good, name: good[name].numpy()}  # its shape compares equal to the tensor's
    cases = (
        (missing, "missing"),
        (wrong, "wrong shape"),
        (extra, "unknown"),
        (nan, "not finite"),
        (array, "not a tensor"),
    )
    for bad, words in cases:
        with pytest.raises(ValueError, match=words) as info:
            runner.load_weights(bad)
        assert "model." in str(info.value)
        for k, v in runner.model.state_dict().items():
            assert torch.equal(v, before[k]), k  # nothing copied before the refusal
    runner.load_weights({k: v * 2 for k, v in good.items()})
    assert torch.equal(runner.model.state_dict()[name], good[name] * 2)


def test_a_tied_parameter_comes_under_either_name(tmp_path):
    """The demo draft ties its output layer to its embedding: either name gives the
    parameter, both must agree."""
    from tests.conftest import DEMO_DRAFT

    runner = ModelRunner(DEMO_DRAFT, max_num_seqs=1)
    good = {k: v.clone() for k, v in runner.model.state_dict().items()}
    assert torch.equal(good["lm_head.weight"], good["model.embed_tokens.weight"])
    differ = {**good, "lm_head.weight": good["lm_head.weight"] + 1}
    with pytest.raises(ValueError, match="tied names that differ"):
        runner.load_weights(differ)
    only_head = {k: v * 2 for k, v in good.items() if k != "model.embed_tokens.weight"}
    runner.load_weights(only_head)
    assert torch.equal(runner.model.model.embed_tokens.weight, good["lm_head.weight"] * 2)


def test_a_stopped_branch_drafted_for_a_shorter_k_than_now_asked_is_drafted_on(tiny_draft):
    """The length policy asked for 3 drafts, then for 6: a branch the outcome stopped
    holding its 3 is drafted on to what drafting afresh gives for 6, not served short."""
    runner = ModelRunner(tiny_draft, max_num_seqs=40)
    drafter = SpeculativeDrafter(DraftModelProposer(runner, min_confidence=0.0))
    drafter.add("g", [5, 9, 14], SamplingParams(temperature=0.0, max_tokens=50))
    drafter.propose(["g"], [3])
    branches = drafter.speculate(["g"], budget=4)
    hit = branches[0]
    assert len(hit.drafts.tokens) == 3 and hit.k == 3 and not hit.drafts.cut
    hit.drafts.complete = False  # stopped by the message just after its last step
    drafter.commit("g", list(hit.guess))
    got = drafter.propose(["g"], [6])[0]
    assert got.speculative
    assert got.tokens == _fresh_drafts(tiny_draft, hit.state.token_ids, 6, 0.0)
