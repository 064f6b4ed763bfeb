"""Fused draft steps (specdec.draft_steps): a compiled draft's steps after the first of a
round run in graphs of several; the drafts, their counts and candidates are the ones the
draft proposes step by step, and once warm no round recompiles."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.draft_steps import CHUNK_SIZES, FusedDraftSteps, StepsShape, chunk_sizes
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState

GREEDY = SamplingParams(temperature=0.0)


def test_chunk_sizes_cover_the_steps_with_the_graphs_there_are():
    assert chunk_sizes(0, False) == chunk_sizes(0, True) == []
    assert chunk_sizes(3, False) == [2, 1]
    assert chunk_sizes(11, False) == [4, 4, 2, 1]  # fewest graphs: no stop to look for
    assert chunk_sizes(11, True) == [1, 2, 4, 4]  # a stop is seen after 1, 3, 7 steps
    assert chunk_sizes(5, True) == [1, 2, 2]
    assert chunk_sizes(3, True, (1, 2)) == [1, 2]
    for n in range(40):
        for ascending in (False, True):
            chunks = chunk_sizes(n, ascending)
            assert sum(chunks) == n and set(chunks) <= set(CHUNK_SIZES)
    with pytest.raises(ValueError, match="ascend from 1"):
        FusedDraftSteps(None, "x", (2, 4))


def _clear(prop, row: int) -> int:
    """How many of a row's proposed positions come before its first near-tie (its two
    likeliest tokens' probabilities within 0.1 % of each other): two correct kernels may
    pick differently there."""
    n = prop.host_num_draft_tokens[row]
    p = prop.top_probs[row, :n]  # [n, m]
    gaps = (p[:, 0].log() - p[:, 1].log()).tolist()  # [n]
    return next((j for j, gap in enumerate(gaps) if gap < 1e-3), n)


# Families whose one-token passes differ: grouped-query heads with rope scaling, a window
# the contexts cross, learned positions (each family's graphs take ~40 s to build here),
# with a confidence stop that ends some rows early and not all at once (OPT's tiny random
# draft spreads its probability over 50k ids: it is never 2 % sure).
FUSED_FAMILIES = {"llama3": 0.02, "mistral": 0.02, "opt": 2e-5}


@pytest.mark.parametrize(("name", "min_confidence"), FUSED_FAMILIES.items())
def test_fused_steps_propose_what_step_by_step_proposes(
    name, min_confidence, family_models, device
):
    """Rounds at batch 1 and of ragged rows, k from 1 to 7, the confidence stop on, top-4
    candidates: the compiled draft with fused steps (warm, frozen, no recompiles) and the
    eager draft step by step propose the same tokens, counts and candidates' probabilities
    (up to a near-tie, where two correct kernels may differ)."""
    _, draft_dir, _ = family_models[name]
    kw = dict(max_num_seqs=6, max_model_len=256, device=device)
    compiled = ModelRunner(draft_dir, execution_mode="torch_compile", **kw)
    compiled.warm_up()
    eager = ModelRunner(draft_dir, **kw)
    limit = compiled.vocab_size - 7  # ids past it are never proposed
    fused = DraftModelProposer(compiled, min_confidence=min_confidence, vocab_limit=limit)
    assert fused.fused is not None
    fused.fused = FusedDraftSteps(compiled, name, sizes=(1, 2))  # (fewer graphs to build)
    seconds = fused.warm_up(top_m=4)
    assert set(seconds) == {
        str(StepsShape(rows, size, 4)) for rows in (True, False) for size in (1, 2)
    }
    stepwise = DraftModelProposer(eager, min_confidence=min_confidence, vocab_limit=limit)
    assert stepwise.fused is None
    rng = random.Random(0)
    rows = positions = fused_positions = 0  # compared whole, compared, fused of those
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (1, 2):
            prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(14, 30))]]
            prompts += [[rng.randrange(3, 60) for _ in range(5)]] * (batch - 1)
            seqs = {
                p: [SequenceState(f"{batch}-{i}", list(t), GREEDY) for i, t in enumerate(prompts)]
                for p in ("fused", "stepwise")
            }
            for _ in range(12):
                k = rng.randint(1, 7)
                a = fused.propose(seqs["fused"], k, top_m=4)
                b = stepwise.propose(seqs["stepwise"], k, top_m=4)
                for row in range(batch):
                    n, clear = b.host_num_draft_tokens[row], _clear(b, row)
                    got = a.host_draft_token_ids[row][:clear]
                    assert got == b.host_draft_token_ids[row][:clear], (name, batch, k, row)
                    torch.testing.assert_close(
                        a.top_probs[row, :clear], b.top_probs[row, :clear], rtol=1e-3, atol=1e-4
                    )
                    if clear == n:  # no tie decided where drafting stopped
                        assert a.host_num_draft_tokens[row] == n
                        rows += 1
                    positions += clear
                    fused_positions += max(0, clear - 1)  # past the first: fused steps
                    assert max(a.host_draft_token_ids[row][:n]) < limit
                # commit some drafts and a token of the target's, alike for both
                for row in range(batch):
                    n = b.host_num_draft_tokens[row]
                    keep = b.host_draft_token_ids[row][: rng.randint(0, n)]
                    token = rng.randrange(3, 60)
                    for p in ("fused", "stepwise"):
                        seqs[p][row].output_token_ids.extend([*keep, token])
            for p, proposer in (("fused", fused), ("stepwise", stepwise)):
                for s in seqs[p]:
                    proposer.free(s.seq_id)
    # (of 36 rows: most were clear, and fused steps drafted many of their positions)
    assert rows >= 18 and positions >= 40 and fused_positions >= 10, (
        rows,
        positions,
        fused_positions,
    )
    assert not fused.fused.eager_shapes and not compiled._compiled.eager_shapes
    assert compiled.num_seqs == 0


def test_a_row_near_max_model_len_is_refused_as_step_by_step(tiny_draft, device):
    """Fused steps that would run a row past max_model_len raise as a step would, and the
    proposer's next call drafts from the committed tokens again."""
    runner = ModelRunner(
        tiny_draft, execution_mode="torch_compile", max_num_seqs=2, max_model_len=24, device=device
    )
    runner.warm_up()
    proposer = DraftModelProposer(runner)
    proposer.fused = FusedDraftSteps(runner, "tiny", sizes=(1, 2))
    seq = SequenceState("a", list(range(3, 23)), GREEDY)  # 20 tokens: room for 4 more
    with pytest.raises(ValueError, match="max_model_len"):
        proposer.propose([seq], 6)
    prop = proposer.propose([seq], 3)
    assert prop.host_num_draft_tokens == [3]
    proposer.free("a")
