"""Prompt-lookup (n-gram) drafts: continue the latest earlier occurrence of a sequence's
last n tokens. Pure numpy, apart from the model proposers: the engine core drafts n-gram
rows itself, and the modules the Serve replica imports to start the core must not pull the
draft model's stack (transformers, dynamo) into the replica."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_propose(token_ids: Sequence[int], k: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Prompt-lookup proposal: continue the latest earlier match of the last n tokens.

    Tries n = n_max down to n_min; for the first n whose suffix occurs earlier in
    ``token_ids``, returns up to ``k`` tokens that followed its most recent earlier
    occurrence (it may overlap the suffix, not be it). Returns [] when nothing matches.

    One vectorised comparison per n (numpy, O(len * n) in C): the engine core calls this
    for every n-gram row of every round, on contexts of thousands of tokens, where a scan
    in Python took milliseconds a row.
    """
    length = len(token_ids)
    if k <= 0 or length < 2:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)  # [length]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # [length - n, n]: every earlier window tokens[s : s + n], s = 0 .. length - n - 1
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
