"""Distillation rows, training and validation on a tiny random Llama (no Ray)."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adaptation.distill import (
    IGNORE,
    DistillSettings,
    TrainingRow,
    collate,
    distill,
    training_rows,
)
from adaptation.retention import RetainedRequest
from adaptation.validation import agreement, judge, split_held_back

VOCAB = 64


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def rec(prompt, output, domain="d") -> RetainedRequest:
    return RetainedRequest(domain, tuple(prompt), tuple(output), 0.0)


def test_rows_keep_the_output_and_the_prompts_tail():
    (row,) = training_rows([rec(range(1, 11), range(20, 26))], max_len=10)
    assert row.token_ids == (7, 8, 9, 10, 20, 21, 22, 23, 24, 25) and row.output_start == 4
    (long,) = training_rows([rec([1, 2], range(30, 50))], max_len=8)
    assert long.token_ids == (2, 30, 31, 32, 33, 34, 35, 36) and long.output_start == 1
    assert training_rows([rec([1, 2], [])], max_len=8) == []


def test_labels_are_the_output_tokens_only():
    rows = [TrainingRow((1, 2, 3, 9, 8), 3), TrainingRow((4, 7), 1)]
    ids, mask, labels = collate(rows, pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3, 9, 8], [4, 7, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position j predicts token j + 1; only output tokens are targets
    assert labels.tolist() == [
        [IGNORE, IGNORE, 9, 8, IGNORE],
        [7, IGNORE, IGNORE, IGNORE, IGNORE],
    ]


def greedy_records(model, prompts, n_new: int, domain: str) -> list[RetainedRequest]:
    """What a target ``model`` would have committed greedily: its own argmax outputs."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        out.append(rec(p, gen[0, len(p) :].tolist(), domain))
    return out


def test_a_draft_distilled_on_a_targets_outputs_agrees_with_it_more():
    target, draft = tiny(0), tiny(1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (6,), generator=gen).tolist() for _ in range(24)]
    rows = training_rows(greedy_records(target, prompts, 12, "d"), 64)
    train, held = split_held_back(rows, 0.25)
    assert len(held) == 6 and not set(held) & set(train)
    # The target agrees with its own greedy outputs everywhere: the score's ceiling.
    assert agreement(target, held) == 1.0
    before = agreement(draft, held)
    logs = []
    report = distill(
        draft, train, [], DistillSettings(steps=60, lr=3e-3, log_every=20), log=logs.append
    )
    after = agreement(draft, held)
    assert report.steps == 60 and not report.stopped_by_time and report.tokens == 60 * 16 * 12
    assert report.last_loss < report.first_loss and len(logs) == 3
    assert after > before + 0.2, (before, after)
    assert not draft.training  # left in eval mode


def test_token_level_at_top_1_on_greedy_outputs_is_sequence_level():
    """On a target's greedy outputs its top-1 distribution is the committed token, so
    token-level distillation at top_k = 1 takes the very steps sequence-level takes."""
    target = tiny(0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (5,), generator=gen).tolist() for _ in range(8)]
    rows = training_rows(greedy_records(target, prompts, 6, "d"), 64)
    settings = DistillSettings(steps=3, lr=3e-3, teacher_top_k=1, batch_size=4)
    seq, tok = tiny(1), tiny(1)
    a = distill(seq, rows, [], settings)
    b = distill(tok, rows, [], settings, teacher=target)
    assert a.first_loss == pytest.approx(b.first_loss, rel=1e-5)
    for p, q in zip(seq.parameters(), tok.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_token_level_distillation_brings_the_draft_to_the_teachers_distribution():
    """At top_k = 16 the draft learns the teacher's whole top of the distribution: its
    KL to the teacher's (top-16, renormalised) distribution at output positions falls
    further than sequence-level training on the same rows and steps takes it."""
    target = tiny(0)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (6,), generator=gen).tolist() for _ in range(24)]
    rows = training_rows(greedy_records(target, prompts, 10, "d"), 64)

    def kl_to_teacher(model) -> float:
        ids, mask, labels = collate(rows, 0, torch.device("cpu"))
        keep = labels != IGNORE
        with torch.no_grad():
            t = target(input_ids=ids, attention_mask=mask).logits[keep]
            top, index = t.topk(16, dim=-1)
            w = torch.softmax(top, dim=-1)
            log_q = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[keep], -1)
        return float((w * (w.log() - log_q.gather(1, index))).sum(-1).mean())

    settings = DistillSettings(steps=60, lr=3e-3, teacher_top_k=16)
    seq, tok = tiny(1), tiny(1)
    before = kl_to_teacher(seq)
    distill(seq, rows, [], settings)
    distill(tok, rows, [], settings, teacher=target)
    assert kl_to_teacher(tok) < 0.5 * kl_to_teacher(seq) < before, (
        before,
        kl_to_teacher(seq),
        kl_to_teacher(tok),
    )


def test_a_run_trains_where_gradients_were_turned_off():
    """Serving code (and benchmarks in the same process) turn gradients off globally."""
    rows = [TrainingRow((1, 2, 3, 4), 2)]
    model = tiny(0)
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    with torch.no_grad():
        report = distill(model, rows, [], DistillSettings(steps=2))
        # The setting restored: still off. (Not checked after the block: a test before this
        # one in the same process may have turned gradients off for good, as serving does.)
        assert not torch.is_grad_enabled()
    assert report.steps == 2
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before)


def test_a_run_stops_at_its_time_budget():
    rows = [TrainingRow((1, 2, 3, 4), 2)]
    report = distill(tiny(0), rows, rows, DistillSettings(steps=10_000, max_seconds=0.5))
    assert report.stopped_by_time and 0 < report.steps < 10_000
    with pytest.raises(ValueError, match="no training rows"):
        distill(tiny(0), [], rows, DistillSettings())


def test_judge_deploys_only_a_gain_that_costs_the_others_little():
    before = {"prose": 0.30, "python": 0.80, "sql": 0.60}
    ok = judge(before, {"prose": 0.50, "python": 0.77, "sql": 0.61}, "prose", min_gain=0.1)
    assert ok.deploy and ok.gain == pytest.approx(0.2) and ok.worst_other == "python"
    small = judge(before, {"prose": 0.35, "python": 0.80, "sql": 0.60}, "prose", min_gain=0.1)
    assert not small.deploy and "min_gain" in small.reason
    forgot = judge(before, {"prose": 0.60, "python": 0.70, "sql": 0.60}, "prose", min_gain=0.1)
    assert not forgot.deploy and forgot.worst_other == "python" and "python lost" in forgot.reason
    alone = judge({"prose": 0.3}, {"prose": 0.45}, "prose", min_gain=0.1)
    assert alone.deploy and alone.worst_other is None
    assert not judge({"prose": math.nan}, {"prose": 0.5}, "prose", min_gain=0.1).deploy
    # An unscored domain says nothing, in whatever order it comes; a domain the candidate
    # cannot be scored on is lost.
    for order in (("sql", "python"), ("python", "sql")):
        b = {"prose": 0.3, **{d: (math.nan if d == "sql" else 0.8) for d in order}}
        a = {"prose": 0.5, "sql": math.nan, "python": 0.8}
        assert judge(b, a, "prose", min_gain=0.1).deploy, order
    lost = judge({"prose": 0.3, "sql": 0.6}, {"prose": 0.5, "sql": math.nan}, "prose", 0.1)
    assert not lost.deploy and lost.worst_other == "sql"


def test_a_repeated_request_is_never_on_both_sides():
    rows = [TrainingRow((1, 2, 3), 1)] * 3 + [TrainingRow((4, 5, 6), 1), TrainingRow((7, 8), 1)]
    train, held = split_held_back(rows, 0.34)
    assert len(held) == 1 and len(train) == 2 and not set(train) & set(held)
