"""Fused draft steps (specdec.draft_steps): a compiled draft's one-token steps of a round
run in graphs of several; the drafts, their counts and candidates are the ones the draft
proposes step by step, and once warm no round recompiles."""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specdec.draft_steps import (
    CHUNK_SIZES,
    FusedDraftSteps,
    GraphedDraftSteps,
    StepsShape,
    chunk_sizes,
)
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
# each with a confidence stop near the 20th percentile of its draft's top probability
# (measured: 0.03-0.5 for Llama 3's, 0.06-0.93 for Mistral's), so that rows stop early but
# not all at once; OPT's spreads itself over 50k ids (5e-4-5e-3, and its near-ties leave
# few rows whose stop can be compared): its threshold only keeps the stop in the graph.
FUSED_FAMILIES = {"llama3": 0.08, "mistral": 0.12, "opt": 2e-5}


# The same comparison with the draft on CUDA graphs (a round's steps as one recorded
# graph; on a CPU the same padded steps eagerly): grouped heads, and a window crossed.
CASES = [(n, c, "torch_compile") for n, c in FUSED_FAMILIES.items()]
CASES += [("llama3", 0.08, "cuda_graph"), ("mistral", 0.12, "cuda_graph")]


@pytest.mark.parametrize(("name", "min_confidence", "mode"), CASES)
def test_fused_steps_propose_what_step_by_step_proposes(
    name, min_confidence, mode, family_models, device
):
    """Rounds at batch 1 and of ragged rows (3 rows in an order other than their slots'),
    k from 1 to 7, the confidence stop on, top-4 candidates, half the ids out of bounds:
    the compiled draft with fused steps (warm, frozen, no recompiles) and the eager draft
    step by step propose the same tokens, counts and candidates' probabilities (up to a
    near-tie, where two correct kernels may differ), and their caches hold what each
    proposer says they hold."""
    _, draft_dir, _ = family_models[name]
    kw = dict(max_num_seqs=6, max_model_len=256, device=device)
    compiled = ModelRunner(draft_dir, execution_mode=mode, **kw)
    compiled.warm_up()
    eager = ModelRunner(draft_dir, **kw)
    limit = compiled.vocab_size // 2  # ids at or past it are never proposed
    fused = DraftModelProposer(compiled, min_confidence=min_confidence, vocab_limit=limit)
    if mode == "cuda_graph":  # a round of up to 8 steps in one graph
        assert isinstance(fused.fused, GraphedDraftSteps)
        seconds = fused.warm_up(top_m=4)  # (recorded on CUDA; nothing to build here)
        assert bool(seconds) == (torch.device(device).type == "cuda")
    else:
        fused.fused = FusedDraftSteps(compiled, name, sizes=(1, 2))  # (fewer graphs to build)
        seconds = fused.warm_up(top_m=4)
        assert set(seconds) == {
            str(StepsShape(rows, size, 4)) for rows in (True, False) for size in (1, 2)
        }
    stepwise = DraftModelProposer(eager, min_confidence=min_confidence, vocab_limit=limit)
    assert stepwise.fused is None
    first_steps = _record_first_steps(fused.fused)
    rng = random.Random(0)
    rows = positions = fused_positions = stops_in_fused = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (1, 2, 3):
            prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(14, 30))]]
            prompts += [[rng.randrange(3, 60) for _ in range(5 + i)] for i in range(batch - 1)]
            seqs = {
                p: [SequenceState(f"{batch}-{i}", list(t), GREEDY) for i, t in enumerate(prompts)]
                for p in ("fused", "stepwise")
            }
            for round_no in range(10):
                k = rng.randint(1, 7)
                # after the first round (which took slots in this order), another order
                order = list(range(batch)) if round_no == 0 else rng.sample(range(batch), batch)
                props = {}
                for p, proposer in (("fused", fused), ("stepwise", stepwise)):
                    props[p] = proposer.propose([seqs[p][i] for i in order], k, top_m=4)
                    for s in seqs[p]:  # what the cache holds is what the proposer records
                        assert proposer.runner.length(s.seq_id) == len(proposer._cached[s.seq_id])
                a, b = props["fused"], props["stepwise"]
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
                        stops_in_fused += int(2 <= n < k)  # a count the graph set
                    positions += clear
                    fused_positions += max(0, clear - 1)  # (at least: those past the first)
                    for prop in (a, b):  # no candidate at or past the limit
                        assert int(prop.top_token_ids[row, :n].max()) < limit
                # commit some drafts and a token of the target's, alike for both
                for row, i in enumerate(order):
                    n = b.host_num_draft_tokens[row]
                    keep = b.host_draft_token_ids[row][: rng.randint(0, n)]
                    # now and then an id the draft has no embedding row for (a target
                    # with a larger vocabulary may commit one): fed as 0 by both paths
                    no_row = compiled.input_vocab_size + 5
                    token = rng.randrange(3, 60) if rng.random() < 0.8 else no_row
                    for p in ("fused", "stepwise"):
                        seqs[p][i].output_token_ids.extend([*keep, token])
            for p, proposer in (("fused", fused), ("stepwise", stepwise)):
                for s in seqs[p]:
                    proposer.free(s.seq_id)
    # (of 60 rows: most were clear, and fused steps drafted many of their positions)
    assert rows >= 30 and positions >= 60 and fused_positions >= 15, (
        rows,
        positions,
        fused_positions,
    )
    if name != "opt":
        assert stops_in_fused >= 1  # a count set inside a graph, compared
    # Rounds that fed one committed token ran their first step in a graph too. Where
    # drafting stops early (a CPU) graphs grow 1, 2, 3, ... steps, so some start past the
    # second position; elsewhere a round's steps after its first pass are one graph.
    assert first_steps.count(0) >= 10, first_steps
    if fused.stop_early:
        assert max(first_steps) >= 2, first_steps
    else:
        assert set(first_steps) <= {0, 1}, first_steps
    assert not fused.fused.eager_shapes
    if mode == "torch_compile":
        assert not compiled._compiled.eager_shapes
    assert compiled.num_seqs == 0


def test_largest_graphs_first_a_stop_between_graphs_and_graphs_gone_eager(tiny_draft, device):
    """The production sizes (1, 2, 4) largest first (no confidence stop: an accelerator's
    schedule), argmax without candidates (top_m 0), one row, k up to 12: the same drafts
    as the eager draft step by step. A ``should_stop`` that fires between two graphs ends
    the proposal with None, and the next one drafts as step by step does. Graphs that miss
    their guards once warm are drafted one step at a time from then on, alike."""
    kw = dict(max_num_seqs=1, max_model_len=256, device=device)  # one slot: 1-row graphs
    compiled = ModelRunner(tiny_draft, execution_mode="torch_compile", **kw)
    compiled.warm_up()
    fused = DraftModelProposer(compiled)
    assert set(fused.warm_up(top_m=0)) == {str(StepsShape(True, n, 0)) for n in CHUNK_SIZES}
    stepwise = DraftModelProposer(ModelRunner(tiny_draft, **kw))
    seqs = [SequenceState("a", list(range(3, 20)), GREEDY) for _ in range(2)]
    rng = random.Random(1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for k in (0, 12, 7, 5, 3, 2, 1, 12):  # (k = 0 with a prompt to feed: nothing runs)
            a, b = fused.propose([seqs[0]], k), stepwise.propose([seqs[1]], k)
            assert a.host_draft_token_ids == b.host_draft_token_ids, k
            assert a.host_num_draft_tokens == b.host_num_draft_tokens == [k]
            keep = b.host_draft_token_ids[0][: rng.randint(0, k)]
            for s in seqs:
                s.output_token_ids.extend([*keep, 9])
        asked = iter([False, False, True])  # k = 12: two graphs (or step 0 and one), stop
        assert fused.propose([seqs[0]], 12, should_stop=lambda: next(asked)) is None
        assert compiled.length("a") == len(fused._cached["a"])
        a, b = fused.propose([seqs[0]], 12), stepwise.propose([seqs[1]], 12)
        assert a.host_draft_token_ids == b.host_draft_token_ids
    assert not fused.fused.eager_shapes and fused.fused.can_run(["a"], 4, 0)
    # Under a function mode every warm graph misses its guards: that call runs them
    # eagerly, the same drafts; from then on those steps are drafted one by one.
    for s in seqs:
        s.output_token_ids.extend([*b.host_draft_token_ids[0][:3], 9])
    for _ in range(2):
        with _PassThrough():
            a, b = fused.propose([seqs[0]], 12), stepwise.propose([seqs[1]], 12)
        assert a.host_draft_token_ids == b.host_draft_token_ids
        assert StepsShape(True, 4, 0) in fused.fused.eager_shapes
        assert not fused.fused.can_run(["a"], 4, 0)
        for s in seqs:
            s.output_token_ids.extend([*b.host_draft_token_ids[0][:3], 9])


def _record_first_steps(steps: FusedDraftSteps) -> list[int]:
    """The list that each later :meth:`FusedDraftSteps.run` call appends its
    ``first_step`` to (the call itself unchanged)."""
    calls: list[int] = []
    run = steps.run

    def recorded(*args, **kwargs):
        calls.append(kwargs["first_step"])
        return run(*args, **kwargs)

    steps.run = recorded
    return calls


class _PassThrough(TorchFunctionMode):
    """A function mode that changes nothing (as a profiler's or a counter's would)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_row_near_max_model_len_is_refused_as_step_by_step(tiny_draft, device):
    """Near max_model_len the steps that still fit are drafted (one by one where a graph
    would not fit) and the one past it raises as a step would; the proposer's next call
    drafts from the committed tokens again."""
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
