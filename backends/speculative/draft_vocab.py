"""A proposer's output layer over the most frequent tokens only (FR-Spec, EAGLE-3's d2t).

A draft token is an argmax; when it is among the few thousand most frequent tokens of
the training data (most are), computing the other rows of the lm_head is wasted. The
token counts ship with the proposer checkpoint (``token_frequencies.json``, written by
``tandem train token-frequencies``); ``SpeculativeConfig.draft_vocab_size`` picks how
many of the most frequent ids the proposer scores. Verification is unchanged, so the
output stays exactly the target's: only how often drafts are accepted can change.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

FREQUENCIES_FILE = "token_frequencies.json"


def rank_by_frequency(stream: torch.Tensor, vocab_size: int) -> tuple[list[int], list[int]]:
    """Token ids by descending count in ``stream`` (ties: lower id first), and the counts.

    >>> rank_by_frequency(torch.tensor([3, 1, 3, 2, 3, 1]), 5)
    ([3, 1, 2, 0, 4], [3, 2, 1, 0, 0])
    """
    counts = torch.bincount(stream.long().flatten(), minlength=vocab_size)[:vocab_size]
    # a stable sort on -count keeps ids ascending among equal counts
    order = torch.sort(-counts, stable=True).indices
    return order.tolist(), counts[order].tolist()


def coverage(counts: list[int], size: int) -> float:
    """Share of the counted tokens that the ``size`` most frequent ones cover.

    >>> coverage([6, 3, 1, 0], 2)
    0.9
    """
    total = sum(counts)
    return sum(counts[:size]) / total if total else 0.0


def save_frequencies(path: str | Path, ids: list[int], counts: list[int], source: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"source": source, "num_tokens": sum(counts),
                                "ids": ids, "counts": counts}) + "\n")


def load_frequent_ids(model_dir: str | Path, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids from ``model_dir/token_frequencies.json``,
    ascending; errors name the file and what is wrong."""
    path = Path(model_dir) / FREQUENCIES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"draft_vocab_size={size} needs {path} "
                                "(write it with `tandem train token-frequencies`)")
    ids = json.loads(path.read_text())["ids"]
    if not 1 <= size <= len(ids) or any(not 0 <= i < vocab_size for i in ids[:size]):
        raise ValueError(f"draft_vocab_size={size}: {path} ranks {len(ids)} token ids, "
                         f"allowed 1..{len(ids)} of a vocabulary of {vocab_size}")
    return torch.tensor(sorted(ids[:size]), dtype=torch.long)
