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


class NgramIndex:
    """One sequence's n-grams (``min_n..max_n`` tokens) that have a token after them, each
    with the end of its latest occurrence, kept up to date as tokens are appended: a
    proposal costs a few dict lookups instead of a scan of the whole sequence, with
    :func:`propose_ngram`'s answers.

    >>> index = NgramIndex(max_n=3)
    >>> index.propose([1, 2, 3, 4, 9, 1, 2, 3].__getitem__, 8, k=3)
    [4, 9, 1]
    """

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, max(min_n, 1)
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0     # n-grams ending before this position are in ``latest``

    def propose(self, tokens, length: int, k: int) -> list[int] | None:
        """``tokens(slice)``: the sequence's tokens in a slice of its first ``length``."""
        if length - 1 > self.indexed:   # index the n-grams ending at indexed..length-2
            first = max(0, self.indexed - self.max_n + 1)
            new = tokens(slice(first, length - 1))
            for end in range(self.indexed, length - 1):
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    self.latest[tuple(new[end - n + 1 - first:end + 1 - first])] = end
            self.indexed = length - 1
        tail = tokens(slice(max(0, length - self.max_n), length))
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.latest.get(tuple(tail[len(tail) - n:]))
            if end is not None:
                return list(tokens(slice(end + 1, min(end + 1 + k, length))))
        return None


class NgramProposer:
    """The ``ngram`` method's :class:`~.base.Proposer`, without a model or KV. A sequence
    is ready when its tokens hold a match; a batch speculates only when all of its
    sequences are, otherwise it decodes plainly (a verify step of k+1 positions costs
    more than a decode step, so a sequence without a proposal is not padded into one)."""
    name = "ngram"
    fallback_method = None

    def __init__(self, k: int, max_n: int, min_n: int):
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self._found: dict[str, list[int]] = {}   # this step's proposals, by request id
        # per request id: its sequence and its n-gram index (a new sequence under an old
        # id gets a new index)
        self._index: dict[str, tuple[Sequence, NgramIndex]] = {}

    def ready(self, seq: Sequence) -> bool:
        held = self._index.get(seq.request_id)
        if held is None or held[0] is not seq:
            held = self._index[seq.request_id] = (seq, NgramIndex(self.max_n, self.min_n))
        found = held[1].propose(lambda s: seq.token_ids(s.start, s.stop), seq.num_tokens, self.k)
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

    def forget(self, request_id: str) -> None:
        """The request ended: drop its index."""
        self._index.pop(request_id, None)
        self._found.pop(request_id, None)

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None,
                 max_lag: int = 0) -> None:
        """Nothing to catch up: no model has to see the tokens."""

    def flush(self, seqs: list[Sequence]) -> None:
        """Nothing left to later."""

    @staticmethod
    def plain_decode_runner() -> None:
        return None     # no model

    def use_fast_decode(self, steps) -> None:
        raise ValueError("prompt lookup has no model to run fast")

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
