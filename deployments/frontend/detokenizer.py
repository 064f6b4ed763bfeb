"""Incremental detokenization with stop strings, O(1) per token, for streaming and final text.

Decoding the whole output at every step costs O(n) per token (quadratic over a stream).
Instead, only a small window of tokens is decoded: ``token_ids[prefix:read]`` is text
already released, ``token_ids[prefix:]`` the same plus the new tokens, and the new text
is the difference. Decoding the window from ``prefix`` rather than from ``read`` keeps
tokenizers that treat a sequence's first token specially (leading spaces) right.

Byte-level BPE tokens can end inside a UTF-8 character: while the window's text ends in
a replacement character the read offset does not move, and the text waits for the next
byte. A stop string can span tokens: the last ``len(longest stop) - 1`` characters are held
back while a stop string could still complete there, so a stop string is always found in
text that has not been released, and text never includes any part of it. With several stop
strings, the text ends before the one that completes first.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix = 0  # window start: tokens before it are fully released
        self.read = 0  # tokens whose text is in released + pending
        self.pending = ""  # decoded, not yet released (held for stop strings)
        self.stopped = False

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def _new_text(self, final: bool) -> str:
        """Text of the tokens after ``read``; empty while it ends inside a character."""
        if self.read == len(self.token_ids):
            return ""
        before = self._decode(self.prefix, self.read)
        after = self._decode(self.prefix, len(self.token_ids))
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # no visible text yet, or an incomplete UTF-8 sequence
        self.prefix, self.read = self.read, len(self.token_ids)
        return after[len(before) :]

    def add(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly releasable text (everything, when ``final``)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        self.pending += self._new_text(final)
        # The stop string that completes first (earliest end; of two ending together, the
        # longer) wins: what a character-by-character stream would have stopped at, so the
        # cut does not depend on how the tokens were grouped into calls.
        cut = end = None
        for s in self.stop:
            pos = self.pending.find(s)
            if pos != -1 and (end is None or (pos + len(s), pos) < (end, cut)):
                cut, end = pos, pos + len(s)
        if cut is not None:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = 0 if final else self.hold
        release = max(0, len(self.pending) - keep)
        out, self.pending = self.pending[:release], self.pending[release:]
        return out
