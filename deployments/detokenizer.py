"""Incremental detokenization with stop strings, for streaming and for final text.

Byte-level BPE tokens can end inside a UTF-8 character, and a stop string can span tokens,
so text is released only when it can no longer change: never a trailing replacement
character, and never the last ``len(longest stop) - 1`` characters while a stop string
could still complete there.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the text already released
        self.stopped = False

    def text(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def add(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly releasable text (everything, when ``final``)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        text = self.text()
        cut = None
        for s in self.stop:
            pos = text.find(s, max(0, self.emitted - len(s)))
            if pos != -1 and (cut is None or pos < cut):
                cut = pos
        if cut is not None:
            self.stopped = True
            out, self.emitted = text[self.emitted : cut], cut
            return out
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end -= 1  # an incomplete UTF-8 sequence: wait for its next byte
            end = max(self.emitted, end - self.hold)
        out, self.emitted = text[self.emitted : end], max(self.emitted, end)
        return out
