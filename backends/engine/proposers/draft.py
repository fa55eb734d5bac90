"""Draft-target speculation's proposer: a small draft model with its own KV, kept one
token ahead of the target's."""
from __future__ import annotations

import itertools

import torch

from ...kv_cache import KVPagePool
from ...models import LlamaForCausalLM
from ..model_runner import ForwardBatch, ModelRunner
from ..sequence import Sequence
from .base import MAX_LAG, DraftProcess, StepHidden
from .vocab import DraftVocab


class DraftModelProposer:
    """Draft-target: the draft has seen every token of the sequence (its KV is one
    token ahead of the target's) and carries its last hidden row, whose logits give the
    next draft (computed only when it drafts: ``propose``).

    ``lazy`` (adaptive speculation): after a step it did not draft in, the draft does not
    run; it catches up on every token it missed at once when it drafts next (or
    :data:`~.base.MAX_LAG` tokens wait)."""
    name = "draft_target"
    fallback_method = None

    def __init__(self, draft: LlamaForCausalLM, pool: KVPagePool,
                 vocab_ids: torch.Tensor | None = None, lazy: bool = False):
        self.runner = ModelRunner(draft, pool)
        self.vocab = DraftVocab(draft.norm, draft.lm_head, vocab_ids)
        # graphed (GPU) or compiled (CPU) decode steps, when the engine has them
        self.fast_decode = None
        self.lazy = lazy

    @staticmethod
    def ready(seq: Sequence) -> bool:
        return seq.draft.computed == seq.num_tokens and seq.draft.hidden is not None

    def in_sync(self, seq: Sequence) -> bool:
        """It can draft for ``seq`` now (lazy: after catching up on the tokens it missed)."""
        return seq.num_computed == seq.num_tokens - 1 if self.lazy else self.ready(seq)

    def method_for(self, seq: Sequence) -> str:
        return self.name

    def drafter(self, method: str) -> "DraftModelProposer":
        return self

    def forget(self, request_id: str) -> None:
        """Nothing kept per request outside ``seq.draft``."""

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None,
                 max_lag: int = MAX_LAG) -> None:
        """Feed the draft the tokens it has not seen, up to one past the target's cache
        (lazy: after a prompt's chunk, or where more than ``max_lag`` wait)."""
        if self.lazy:   # a prompt's chunk at once (its KV is wanted: prefix cache), else late
            seqs = [s for s in seqs if s.num_tokens - s.draft.computed > max_lag
                    or (step_hidden is not None and len(step_hidden[s.request_id][1]) > 1)]
        self._catch_up(seqs)

    def flush(self, seqs: list[Sequence]) -> None:
        """Catch up on every token the draft missed (lazy), for ``seqs``."""
        self._catch_up([s for s in seqs if not self.ready(s)])

    def plain_decode_runner(self) -> ModelRunner:
        return self.runner

    def use_fast_decode(self, steps) -> None:
        self.fast_decode = steps

    def _catch_up(self, seqs: list[Sequence]) -> None:
        todo = [(s, s.draft.computed, min(s.num_tokens, s.num_computed + 1)) for s in seqs]
        todo = [(s, a, b) for s, a, b in todo if b > a]
        if not todo:
            return
        batch = ForwardBatch([s.token_ids(a, b) for s, a, b in todo], [a for _, a, _ in todo],
                             [s.pages for s, _, _ in todo])
        hidden = self._forward(batch, max(batch.qo_lens) - 1)
        last = list(itertools.accumulate(batch.qo_lens))
        for i, (s, _, b) in enumerate(todo):
            s.draft.computed = b
            s.draft.hidden = hidden[last[i] - 1] if b == s.num_tokens else None

    def _forward(self, batch: ForwardBatch, extra: int) -> torch.Tensor:
        """The draft's hidden rows of ``batch`` (up to ``extra + 1`` tokens per sequence):
        through the engine's graphed or compiled steps where they take it, else eager."""
        fast = self.fast_decode
        hidden = None
        if fast is not None:
            hidden = fast.forward(batch) if extra == 0 else \
                getattr(fast, "forward_verify", lambda batch, k: None)(batch, extra)
        return self.runner.forward(batch)[1] if hidden is None else hidden

    def propose(self, seqs: list[Sequence], k: int,
                process: DraftProcess | None = None) -> torch.Tensor:
        self.flush(seqs)
        drafts: list[torch.Tensor] = []
        token = self.vocab.greedy(self.vocab.logits(torch.stack([s.draft.hidden for s in seqs])),
                                  drafts, process)
        drafts.append(token)
        for _ in range(k - 1):
            batch = ForwardBatch([[t] for t in token.tolist()], [s.draft.computed for s in seqs],
                                 [s.pages for s in seqs])
            hidden = self._forward(batch, 0)
            for s in seqs:
                s.draft.computed += 1
            token = self.vocab.greedy(self.vocab.logits(hidden), drafts, process)
            drafts.append(token)
        return torch.stack(drafts, 1)

    def after_verify(self, seqs, tokens, target_hidden, starts) -> None:
        # the draft's KV stays valid only as far as its tokens were accepted
        for s in seqs:
            s.draft.computed = min(s.draft.computed, s.num_computed)
            s.draft.hidden = None
        self.catch_up(seqs)   # lazy: only where many tokens wait
