"""``--spec auto``'s proposer: prompt lookup for a sequence whose tokens hold a match
(free to draft, often long accepted runs), the model proposer (MTP head or draft)
otherwise. The model's KV follows every sequence all the time -- after a step drafted
by ngram, or a plain one, it catches up on the accepted tokens as it does after its own
drafts -- so it can draft for any sequence at any step."""
from __future__ import annotations

from typing import Callable

import torch

from ..sequence import Sequence
from .base import MAX_LAG, DraftProcess, Proposer, StepHidden
from .ngram import NgramProposer


class AutoProposer:
    """ngram where it matches (and ``use_ngram(request_id)`` allows: the controller
    turns it off for a sequence whose ngram drafts stopped being accepted), the model
    proposer elsewhere; ``drafter(method)`` is the one that drafts by ``method``."""
    name = "auto"

    def __init__(self, ngram: NgramProposer, model: Proposer,
                 use_ngram: Callable[[str], bool] = lambda request_id: True):
        self.ngram, self.model, self.use_ngram = ngram, model, use_ngram
        self.runner = model.runner     # the proposer's KV pool, as a model proposer's

    @property
    def fallback_method(self) -> str:
        return self.model.name

    def ready(self, seq: Sequence) -> bool:
        return self.model.ready(seq)

    def in_sync(self, seq: Sequence) -> bool:
        return self.model.in_sync(seq)

    def method_for(self, seq: Sequence) -> str:
        if self.use_ngram(seq.request_id) and self.ngram.method_for(seq) is not None:
            return self.ngram.name
        return self.model.name

    def drafter(self, method: str) -> Proposer:
        return self.ngram if method == self.ngram.name else self.model

    def forget(self, request_id: str) -> None:
        self.ngram.forget(request_id)
        self.model.forget(request_id)

    def flush(self, seqs: list[Sequence]) -> None:
        self.model.flush(seqs)

    def plain_decode_runner(self):
        return self.model.plain_decode_runner()

    def use_fast_decode(self, steps) -> None:
        self.model.use_fast_decode(steps)

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None,
                 max_lag: int = MAX_LAG) -> None:
        self.model.catch_up(seqs, step_hidden, max_lag)

    def propose(self, seqs: list[Sequence], k: int,
                process: DraftProcess | None = None) -> torch.Tensor:
        """Each sequence's drafts from its method (``process`` only when they all share
        one: the rows it changes are the batch's)."""
        methods = [self.method_for(s) for s in seqs]
        out = torch.empty(len(seqs), k, dtype=torch.long)
        for method in set(methods):
            rows = [i for i, m in enumerate(methods) if m == method]
            out[rows] = self.drafter(method).propose(
                [seqs[i] for i in rows], k, process if len(rows) == len(seqs) else None).cpu()
        return out

    def after_verify(self, seqs, tokens, target_hidden, starts) -> None:
        self.model.after_verify(seqs, tokens, target_hidden, starts)
