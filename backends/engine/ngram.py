"""Prompt lookup (n-gram speculation): propose the tokens that followed the most recent
earlier occurrence of the sequence's last n tokens, in its own prompt and output. No
model, no KV: the proposal costs a search over the sequence's tokens.

>>> propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], k=3, max_n=3)
[4, 9, 1]
>>> propose_ngram([5, 6, 7], k=2, max_n=2) is None    # no earlier occurrence
True
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, k: int, max_n: int = 3, min_n: int = 1
                  ) -> list[int] | None:
    """Up to ``k`` tokens continuing the latest earlier match of the last ``n`` tokens,
    trying ``n = max_n`` down to ``min_n`` (a longer match predicts better); None when
    nothing matches. Fewer than ``k`` when the match is near the end.

    >>> propose_ngram([1, 2, 1, 2, 1], k=4, max_n=2)    # the latest match wins
    [2, 1]
    """
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        if n < 1:
            break
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return None
