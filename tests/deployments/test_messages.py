"""The round's messages on the wire: what :func:`deployments.messages.encode` writes,
:func:`decode` reads back as the same named message, field for field (a sampled row's
``q`` bit for bit, its arrays beside the bytes), and an object without a wire form is
refused, never pickled.
Pure: no Ray, no model."""

from __future__ import annotations

import pytest
import torch

from deployments.messages import (
    DraftItem,
    DraftPush,
    DraftRestart,
    DraftRoundMessage,
    DraftStatus,
    EngineCoreOutput,
    EngineCoreOutputs,
    PushedDraft,
    RoundFeedback,
    TokenLogprob,
    decode,
    encode,
)
from specdec.qcodec import CompactQ
from specdec.stats import SpecCounts


def _outputs(batch: int) -> EngineCoreOutputs:
    lps = [TokenLogprob(-0.25, {7: -0.25, 3: -1.5}), TokenLogprob(None, {})]
    return EngineCoreOutputs(
        cursor=41,
        outputs=[
            EngineCoreOutput(
                f"cmpl-{i}",
                [5, 6],
                i % 2 == 0,
                "stop" if i % 2 == 0 else None,
                12 + i,
                SpecCounts(8, 5, 3, 2, 1),
                None if i else "request failed",
                lps if i == 1 else None,
                lps if i == 2 else None,
            )
            for i in range(batch)
        ],
        error=None,
    )


def test_outputs_round_trip_field_for_field():
    msg = _outputs(4)
    back = decode(EngineCoreOutputs, encode(msg))
    assert back == msg
    assert type(back.outputs[0].spec_counts) is SpecCounts
    # the top log-probabilities keep their order (likeliest first)
    assert list(back.outputs[1].logprobs[0].top) == [7, 3]


def test_round_message_round_trips_with_restarts():
    restart = DraftRestart([1, 2, 3], [4], {"temperature": 0.0, "stop": ["\n"]})
    msg = DraftRoundMessage(
        msg_no=17,
        first=True,
        round_for=9,
        items=[DraftItem("a", 4, [4], 3, restart), DraftItem("c", 10, [8, 9], 0)],
        freed=["b", "d"],
        feedback=RoundFeedback(0.012, 0.02, 5, representative=False),
    )
    assert decode(DraftRoundMessage, encode(msg)) == msg


@pytest.mark.parametrize("dense", [True, False])
def test_push_round_trips_q_bit_for_bit(dense):
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(3, 50, generator=gen).to(torch.float16)
    if not dense:
        w[w < 0.9] = 0  # a truncated support: ids and weights
    q = CompactQ.encode(w)
    assert (q.ids is None) == dense
    push = DraftPush(
        round_for=5,
        drafts=[
            PushedDraft("s", DraftStatus.DRAFTS, (4, 2), [1, 2, 3], q, True),
            PushedDraft("t", DraftStatus.LOST),
            PushedDraft("u", DraftStatus.GAVE_UP, (9,)),
        ],
    )
    wire = encode(push)
    data, arrays = wire  # the arrays travel beside the bytes, as they are (no copy)
    assert isinstance(data, bytes) and arrays and arrays[0] is q.values
    back = decode(DraftPush, [data, arrays])  # (Ray hands the tuple back as a list)
    row = back.drafts[0]
    assert (row.seq_id, row.status, row.guess, row.token_ids, row.speculative) == (
        "s",
        DraftStatus.DRAFTS,
        (4, 2),  # a tuple: the core keys drafts by (round, guess)
        [1, 2, 3],
        True,
    )
    assert torch.equal(row.q.weights("cpu"), w)
    assert torch.equal(row.q.head(2).weights("cpu"), w[:2])
    assert back.drafts[1:] == push.drafts[1:]
    greedy = DraftPush(5, [PushedDraft("s", DraftStatus.DRAFTS, (4,), [1, 2])])
    assert isinstance(encode(greedy), bytes)  # no array: bytes alone


def test_a_tensor_is_refused_not_pickled():
    """Token ids cross as lists, never as tensors (which would drag a device along)."""
    bad = DraftPush(0, [PushedDraft("s", DraftStatus.DRAFTS, (), torch.tensor([1, 2]))])
    with pytest.raises(NotImplementedError, match="Tensor"):
        encode(bad)


def test_round_feedback_from_a_core_without_the_representative_field():
    """A core that sends three fields (before ``representative``): the draft reads its
    rounds as representative, as they were then counted."""
    import msgspec

    old = msgspec.msgpack.encode([0.012, 0.02, 5])
    assert msgspec.msgpack.decode(old, type=RoundFeedback) == RoundFeedback(0.012, 0.02, 5, True)
