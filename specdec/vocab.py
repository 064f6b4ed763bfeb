"""Whether a draft and a target agree on token ids.

Speculation compares token ids, so a draft whose tokenizer maps text to other ids than
the target's proposes tokens the target reads as something else: acceptance near zero,
silently. Equal vocabulary *sizes* prove nothing (two unrelated 32k tokenizers), so the
mappings themselves are compared. Embedding rows past the tokenizer's size are padding
and may differ between the two (Qwen 2.5: 151936 rows for 0.5B, 152064 for 7B).
"""

from __future__ import annotations

from specdec.attention import UnsupportedModelError


def check_tokenizers(target, draft, *, examples: int = 3) -> None:
    """Raise :class:`UnsupportedModelError` unless every token of the target's tokenizer
    (special tokens included) has the same id in the draft's; the draft may know more."""
    t_vocab, d_vocab = target.get_vocab(), draft.get_vocab()
    if t_vocab == d_vocab:
        return
    wrong = [(tok, i, d_vocab.get(tok)) for tok, i in t_vocab.items() if d_vocab.get(tok) != i]
    if not wrong:
        return
    wrong.sort(key=lambda w: w[1])
    shown = ", ".join(
        f"{tok!r}: target {i}, draft {'missing' if j is None else j}"
        for tok, i, j in wrong[:examples]
    )
    raise UnsupportedModelError(
        f"the draft's tokenizer does not agree with the target's on {len(wrong)} of "
        f"{len(t_vocab)} token ids (e.g. {shown}): the pair cannot speculate; use a draft "
        "trained with the target's tokenizer"
    )
