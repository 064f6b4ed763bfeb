import pytest

from specdec.proposers import NgramProposer, ngram_propose
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState


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
