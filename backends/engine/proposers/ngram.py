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
import torch

from ..sequence import Sequence
from .base import DraftProcess, StepHidden


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


class NgramProposer:
    """The ``ngram`` method's :class:`~.base.Proposer`, without a model or KV. A sequence
    is ready when its tokens hold a match; a batch speculates only when all of its
    sequences are, otherwise it decodes plainly (a verify step of k+1 positions costs
    more than a decode step, so a sequence without a proposal is not padded into one)."""
    name = "ngram"

    def __init__(self, k: int, max_n: int, min_n: int):
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self._found: dict[str, list[int]] = {}   # this step's proposals, by request id

    def ready(self, seq: Sequence) -> bool:
        found = propose_ngram(seq.token_ids(0, seq.num_tokens), self.k, self.max_n, self.min_n)
        if not found:
            self._found.pop(seq.request_id, None)
            return False
        self._found[seq.request_id] = found
        return True

    @staticmethod
    def in_sync(seq: Sequence) -> bool:
        return True     # no state to keep up to date

    def method_for(self, seq: Sequence) -> str | None:
        """"ngram" when the sequence's tokens hold a match (kept for :meth:`propose`)."""
        return self.name if self.ready(seq) else None

    def drafter(self, method: str) -> "NgramProposer":
        return self

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None) -> None:
        """Nothing to catch up: no model has to see the tokens."""

    def propose(self, seqs: list[Sequence], k: int,
                process: DraftProcess | None = None) -> torch.Tensor:
        # a match near the end gives fewer than k tokens: the last one repeats (verified
        # like any draft, so only speed depends on it)
        rows = []
        for s in seqs:
            found = self._found.pop(s.request_id)
            rows.append(found[:k] + [found[-1]] * (k - len(found)))
        self._found.clear()   # the matches of sequences that did not draft this step
        return torch.tensor(rows, dtype=torch.long)

    def after_verify(self, seqs, tokens, target_hidden, starts) -> None:
        """Nothing to roll back."""
