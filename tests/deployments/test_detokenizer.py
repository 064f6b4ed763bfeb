"""The incremental detokenizer: same text as a full decode, UTF-8 and stop strings across
tokens, special tokens skipped, and a bounded amount of decoding per token."""

import random

import pytest
from transformers import AutoTokenizer

from deployments.detokenizer import IncrementalDetokenizer
from tests.conftest import DEMO_TARGET

TEXT = (
    "def naïve_sum(xs):\n    # Σ over xs — ünïcödé, 日本語 and emoji 🙂🚀 too\n"
    "    return sum(xs)  # done\n\nThe end. Ça va? Ελληνικά."
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_TARGET)


def stream(tok, ids, stop=(), chunks=1):
    detok = IncrementalDetokenizer(tok, stop)
    pieces = []
    for i in range(0, len(ids), chunks):
        part = ids[i : i + chunks]
        pieces.append(detok.add(part, final=i + chunks >= len(ids)))
    return pieces, detok


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_streamed_text_equals_full_decode_and_never_splits_a_character(tok, chunks):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    # Byte-level BPE: some characters span several tokens (the test needs such a case).
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    pieces, _ = stream(tok, ids, chunks=chunks)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_random_token_streams_match_full_decode(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        pieces, _ = stream(tok, ids, chunks=rng.randrange(1, 4))
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop", ["sum(xs)", "\n\n", "🚀", "Ça"])
def test_stop_string_across_tokens_cuts_exactly_before_it(tok, stop):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    pieces, detok = stream(tok, ids, stop=[stop, "never-there"])
    assert detok.stopped
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]
    assert detok.add(ids[:3]) == ""  # nothing after a stop


def test_held_text_is_released_at_the_end_when_no_stop_matches(tok):
    ids = tok("abc def", add_special_tokens=False)["input_ids"]
    pieces, detok = stream(tok, ids, stop=["zzzzzz"])
    assert not detok.stopped and "".join(pieces) == "abc def"


def test_special_tokens_are_skipped(tok):
    special = tok.convert_tokens_to_ids(tok.all_special_tokens)
    assert special
    ids = tok("x = 1", add_special_tokens=False)["input_ids"]
    mixed = [special[0], *ids[:2], special[-1], *ids[2:], special[0]]
    pieces, _ = stream(tok, mixed)
    assert "".join(pieces) == "x = 1"


def test_decoding_work_per_token_does_not_grow_with_the_output(tok):
    """O(1) per token: the tokens decoded per step stay bounded however long the stream."""
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok(TEXT * 40, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1500
    detok = IncrementalDetokenizer(Counting(), ["never-there"])
    per_step = []
    for t in ids:
        decoded.clear()
        detok.add([t])
        per_step.append(sum(decoded))
    assert max(per_step) <= 16
    assert sum(per_step[-200:]) <= sum(per_step[:200]) * 1.5 + 50
