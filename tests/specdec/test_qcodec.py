"""q in 16 bits between actors: what the verifier rebuilds is, bit for bit, the
distribution the draft sampled from, in both wire forms, at the sizes the issue sets."""

import numpy as np
import torch

from specdec.qcodec import CompactQ, dequantize_q, quantize_q
from specdec.sampling import SamplingParams, probs_for

VOCAB = 128256


def _q(params, n=5, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=gen) * scale
    return quantize_q(probs_for([params] * n, logits))  # [n, vocab] float16


def test_dense_form_is_two_bytes_per_entry_and_exact():
    w = _q(SamplingParams(temperature=1.0))
    wire = CompactQ.encode(w)
    assert wire.ids is None and wire.nbytes == 2 * 5 * VOCAB
    q = dequantize_q(w)
    assert torch.equal(dequantize_q(wire.weights("cpu")), q)
    assert torch.allclose(q.sum(-1), torch.ones(5), atol=1e-6)
    # A peaked q whose tail underflows float16 has a support of its own: sent as such.
    peaked = _q(SamplingParams(temperature=1.0), scale=6.0)
    sparse = CompactQ.encode(peaked)
    assert sparse.ids is not None and torch.equal(sparse.weights("cpu"), peaked)


def test_truncated_q_travels_as_its_support_at_six_bytes_an_entry():
    w = _q(SamplingParams(temperature=0.8, top_k=50, top_p=0.9))
    support = int((w != 0).sum())  # over the 5 positions, each with its own support
    wire = CompactQ.encode(w)
    assert wire.ids is not None and wire.nbytes == 6 * support + 4 * 5 and support <= 5 * 50
    assert torch.equal(wire.weights("cpu"), w)
    assert torch.equal(dequantize_q(wire.weights("cpu")), dequantize_q(w))
    head = wire.head(2)
    assert len(head) == 2 and torch.equal(head.weights("cpu"), w[:2])


def test_the_normalising_sum_does_not_depend_on_the_order():
    """The draft and the verifier may sum in any order (CPU, GPU): float64 is exact here."""
    w = _q(SamplingParams(temperature=1.3), n=3, seed=4)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    shuffled = dequantize_q(w[:, perm])
    assert torch.equal(shuffled[:, torch.argsort(perm)], dequantize_q(w))


def test_zero_rows_and_float32_inputs():
    assert torch.equal(dequantize_q(torch.zeros(2, 7, dtype=torch.float16)), torch.zeros(2, 7))
    q = torch.softmax(torch.randn(2, 7), -1)
    assert dequantize_q(q) is q  # a float32 distribution is taken as it is


def test_encode_batch_equals_encoding_each_row_and_reads_twice():
    """The batched encoder gives every row the form and bytes encode gives it alone, dense
    or by support, and reads the device twice for the whole batch."""
    from specdec.host_syncs import HostSyncCounter
    from specdec.qcodec import encode_batch

    torch.manual_seed(0)
    vocab = 50
    full = torch.softmax(torch.randn(3, vocab), -1)  # dense: every entry non-zero
    truncated = full.clone()
    truncated[truncated < truncated.max(-1, keepdim=True).values / 2] = 0  # a few ids left
    rows = [quantize_q(full), quantize_q(truncated[:2]), quantize_q(full[:1]), truncated[:0]]
    rows[3] = rows[3].to(torch.float16)  # a row with no drafts
    with HostSyncCounter() as counter:
        batch = encode_batch(rows)
    assert counter.total == 2
    for w, got in zip(rows, batch, strict=True):
        want = CompactQ.encode(w)
        assert (got.ids is None) == (want.ids is None) and got.width == want.width
        np.testing.assert_array_equal(got.values, want.values)
        if want.ids is not None:
            np.testing.assert_array_equal(got.ids, want.ids)
            np.testing.assert_array_equal(got.counts, want.counts)
        torch.testing.assert_close(got.weights("cpu"), w, rtol=0, atol=0)
    assert batch[1].ids is not None and batch[0].ids is None  # both forms were exercised
