"""Model runner: batched ragged forward and KV rollback against full recomputation."""

import pytest
import torch

from specdec.runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_target):
    return ModelRunner(tiny_target, max_num_seqs=4)


def full_logits(runner, tokens):
    """Reference: the model over the whole sequence, no cache."""
    with torch.no_grad():
        return runner.model(torch.tensor([tokens])).logits[0].float()


SEQS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [11, 12, 13], "c": [20, 21, 22, 23, 24, 25, 26, 27, 28]}


def test_ragged_batched_forward_matches_full_pass(runner):
    for sid in SEQS:
        runner.add(sid)
    try:
        # Prefill chunks of different lengths in one batch, then continue out of slot order.
        outs = runner.forward(list(SEQS), [v[:3] for v in SEQS.values()])
        for toks, out in zip(SEQS.values(), outs, strict=True):
            torch.testing.assert_close(out, full_logits(runner, toks)[:3], atol=1e-5, rtol=1e-4)
        outs = runner.forward(["c", "a"], [SEQS["c"][3:], SEQS["a"][3:]])
        torch.testing.assert_close(
            outs[0], full_logits(runner, SEQS["c"])[3:], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            outs[1], full_logits(runner, SEQS["a"])[3:], atol=1e-5, rtol=1e-4
        )
        assert runner.length("a") == 7 and runner.length("b") == 3 and runner.length("c") == 9
    finally:
        for sid in SEQS:
            runner.free(sid)


def test_rollback_then_reappend_equals_fresh_prefill(runner):
    runner.add("s")
    try:
        runner.forward(["s"], [[3, 4, 5, 6]])
        runner.forward(["s"], [[7, 8, 9, 10]])  # speculative suffix ...
        runner.rollback("s", 5)  # ... of which only [7] is kept
        assert runner.length("s") == 5
        out = runner.forward(["s"], [[40, 41]])
        fresh = full_logits(runner, [3, 4, 5, 6, 7, 40, 41])[-2:]
        torch.testing.assert_close(out[0], fresh, atol=1e-5, rtol=1e-4)
    finally:
        runner.free("s")


def test_free_compacts_slots_and_keeps_other_caches(runner):
    for sid in SEQS:
        runner.add(sid)
    runner.forward(list(SEQS), list(SEQS.values()))
    runner.free("a")  # 'c' moves from the last slot into 'a's slot
    outs = runner.forward(["c", "b"], [[1], [2]])
    torch.testing.assert_close(
        outs[0][-1], full_logits(runner, [*SEQS["c"], 1])[-1], atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        outs[1][-1], full_logits(runner, [*SEQS["b"], 2])[-1], atol=1e-5, rtol=1e-4
    )
    runner.free("b")
    runner.free("c")
    assert runner.num_seqs == 0


def test_errors_are_clear(runner):
    runner.add("x")
    try:
        with pytest.raises(KeyError, match="already exists"):
            runner.add("x")
        with pytest.raises(ValueError, match="cannot roll"):
            runner.rollback("x", 3)
        with pytest.raises(ValueError, match="at least one token"):
            runner.forward(["x"], [[]])
        with pytest.raises(ValueError, match="max_model_len"):
            runner.forward(["x"], [list(range(90)) * 6])
        for i in range(3):
            runner.add(i)
        with pytest.raises(RuntimeError, match="max_num_seqs"):
            runner.add("overflow")
    finally:
        for sid in ["x", 0, 1, 2]:
            runner.free(sid)
