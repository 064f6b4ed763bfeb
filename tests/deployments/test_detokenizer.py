"""The incremental detokenizer: same text as a full decode, UTF-8 and stop strings across
tokens, special tokens skipped (and never matched by stop strings), the first stop string
to complete wins however tokens are grouped, and a bounded amount of decoding per token."""

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from deployments.frontend.detokenizer import IncrementalDetokenizer
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


# ----- one token at a time, as the engine feeds it when a request has stop strings ---------

SPECIAL_END = "<|end|>"


def feed_like_the_engine(tok, ids, stop):
    """The engine's stop-string path: one token per ``add`` (``final`` on the last), and
    the request keeps tokens up to the one after which ``stopped`` became set.

    Returns ``(released pieces, index of the completing token or None, detokenizer)``."""
    detok = IncrementalDetokenizer(tok, stop)
    pieces = []
    for i, t in enumerate(ids):
        pieces.append(detok.add([t], final=i == len(ids) - 1))
        if detok.stopped:
            return pieces, i, detok
    return pieces, None, detok


def first_stop_cut(text, stop):
    """Reference: ``text`` cut before the stop string that completes first (earliest end;
    of two ending at the same character, the longer), or ``None`` when none occurs."""
    best = None
    for s in (s for s in stop if s):
        pos = text.find(s)
        if pos != -1 and (best is None or (pos + len(s), pos) < best):
            best = (pos + len(s), pos)
    return None if best is None else best[1]


@pytest.mark.parametrize(
    "text", ["🙂", "日本語", "🙂🚀👍🏽 ok", "a𝔘b", "한국어 🇫🇷 中文", "Ελληνικά — ✓"]
)
def test_utf8_split_across_byte_tokens_is_never_released_half_done(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # characters really are split across tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([t]) for t in ids]  # no ``final``: nothing is forced out
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some token ended inside a character and released nothing
    pieces.append(detok.add([], final=True))
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("the quick brown fox", "ck bro"),  # starts mid-token, ends mid-token
        ("the quick brown fox", "quick"),
        ("日本語 🙂🚀 and more", "🙂🚀"),  # byte tokens: the stop completes on a late byte
        ("日本語 🙂🚀 and more", "語 🙂"),
        ("x = 1\n\ny = 2", "\n\ny"),
    ],
)
def test_stop_string_across_tokens_is_cut_exactly_and_its_token_identified(tok, text, stop):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, i, detok = feed_like_the_engine(tok, ids, [stop])
    assert detok.stopped and i is not None
    assert "".join(pieces) == text[: text.index(stop)]
    assert not any("\ufffd" in p for p in pieces)
    # Token i completed the stop string: it is in the text through token i, not before.
    assert stop in tok.decode(ids[: i + 1]) and stop not in tok.decode(ids[:i])
    assert detok.add(ids[i + 1 :], final=True) == ""  # nothing after the stop, ever


def test_stop_strings_match_the_client_text_not_special_tokens(tok):
    ids = tok(f"foo{SPECIAL_END}bar", add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids(SPECIAL_END) in ids  # a real special token
    # The special token's text is not in the client's text: it never matches, alone or
    # as part of a stop string, and it does not break a match across it.
    for stop in [SPECIAL_END, f"o{SPECIAL_END}b", "end", "|"]:
        pieces, i, detok = feed_like_the_engine(tok, ids, [stop])
        assert not detok.stopped and i is None and "".join(pieces) == "foobar", stop
    pieces, i, detok = feed_like_the_engine(tok, ids, ["ob"])  # 'o' | <|end|> | 'b'
    assert detok.stopped and "".join(pieces) == "fo"
    assert tok.decode(ids[i : i + 1]) == "bar"  # completed by the token after the special


def test_special_token_right_before_or_after_a_stop_string(tok):
    end = tok.convert_tokens_to_ids(SPECIAL_END)
    body = tok("say stop now", add_special_tokens=False)["input_ids"]
    ids = [end, *body, end]
    pieces, i, detok = feed_like_the_engine(tok, ids, ["stop"])
    assert detok.stopped and "".join(pieces) == "say "
    assert ids[i] != end  # the special token after it is not needed to see the stop
    pieces, _, detok = feed_like_the_engine(tok, [*body, end], ["now"])
    assert detok.stopped and "".join(pieces) == "say stop "


@pytest.mark.parametrize("chunks", [1, 3, 100])
def test_with_several_stop_strings_the_first_to_complete_wins(tok, chunks):
    text = "the quick brown fox jumps"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # List order does not matter; the earliest occurrence does.
    for stop in (["fox", "quick"], ["quick", "fox"], ["zzz", "own", "jumps"]):
        pieces, detok = stream(tok, ids, stop=stop, chunks=chunks)
        assert detok.stopped
        assert "".join(pieces) == text[: first_stop_cut(text, stop)]
    # Overlapping stops: 'ick' completes (inside ' quick') before 'quick brown' does, so
    # the text ends at 'the qu' however the tokens are grouped: one at a time, in chunks
    # or all at once (it used to be 'the ' when both completed within one call).
    for stop in (["quick brown", "ick"], ["ick", "quick brown"]):
        pieces, detok = stream(tok, ids, stop=stop, chunks=chunks)
        assert "".join(pieces) == "the qu"
    # Two stops ending at the same character: the longer one (earlier start) wins.
    pieces, _ = stream(tok, ids, stop=["own", "brown"], chunks=chunks)
    assert "".join(pieces) == "the quick "


def test_final_flush_releases_the_held_back_text(tok):
    ids = tok("abc def ghi", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, ["ghij", "xyz"])  # 'ghi' could still become 'ghij'
    streamed = "".join(detok.add([t]) for t in ids)
    assert streamed == "abc def "[: len(streamed)] and len(streamed) < len("abc def ghi")
    assert streamed + detok.add([], final=True) == "abc def ghi"
    assert not detok.stopped
    assert detok.add([], final=True) == ""  # flushing twice releases nothing more


# ----- property: streamed == non-streamed == full decode cut at the first stop ------------


@pytest.fixture(scope="module")
def token_pool(tok):
    """Token ids that make interesting text: multi-byte pieces, spaces, specials."""
    ids = tok(TEXT + " 🇫🇷 한국어 a b ab", add_special_tokens=False)["input_ids"]
    special = tok.convert_tokens_to_ids(tok.all_special_tokens)
    return sorted(set(ids) | set(special))


@given(data=st.data())
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_property_streamed_text_equals_the_cut_full_decode(tok, token_pool, data):
    token = st.one_of(st.sampled_from(token_pool), st.integers(0, tok.vocab_size - 1))
    ids = data.draw(st.lists(token, min_size=1, max_size=40), label="ids")
    full = tok.decode(ids, skip_special_tokens=True)
    # Stop strings: pieces of the text (so they occur), random ones, a special token's text.
    piece = st.builds(
        lambda a, n: full[a : a + n], st.integers(0, max(len(full) - 1, 0)), st.integers(1, 8)
    )
    other = st.one_of(st.text("ab 🙂\n", min_size=1, max_size=4), st.just(SPECIAL_END))
    stop = data.draw(st.lists(st.one_of(piece, other), max_size=3), label="stop")
    long = [s for s in stop if len(s) >= 3]
    if long and data.draw(st.booleans(), label="nested"):
        # A stop strictly inside another one starts later but completes first: the case
        # where the cut could depend on how the tokens were grouped into calls.
        outer = data.draw(st.sampled_from(long))
        j = data.draw(st.integers(1, len(outer) - 2))
        stop.append(outer[j : j + data.draw(st.integers(1, len(outer) - 1 - j))])

    cut = first_stop_cut(full, stop)
    expected = full if cut is None else full[:cut]

    whole = IncrementalDetokenizer(tok, stop)  # non-streamed: everything in one call
    assert whole.add(ids, final=True) == expected
    assert whole.stopped == (cut is not None)

    pieces, i, detok = feed_like_the_engine(tok, ids, stop)
    assert "".join(pieces) == expected and detok.stopped == (cut is not None)
    if i is not None:
        through = tok.decode(ids[: i + 1], skip_special_tokens=True)
        before = tok.decode(ids[:i], skip_special_tokens=True)
        assert through.startswith(expected) and first_stop_cut(through, stop) == cut
        # Token i completed it (unless the text before it ended inside a character).
        assert first_stop_cut(before, stop) is None or before.endswith("\ufffd")

    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=40), label="chunks")
    detok, out, pos = IncrementalDetokenizer(tok, stop), [], 0
    for n in itertools.cycle(sizes):
        part, pos = ids[pos : pos + n], pos + n
        out.append(detok.add(part, final=pos >= len(ids)))
        if pos >= len(ids):
            break
    assert "".join(out) == expected
