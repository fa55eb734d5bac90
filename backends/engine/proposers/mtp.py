"""MTP speculation's proposer: a multi-token-prediction head that drafts from the
target's hidden states, through the target's own norm and lm_head."""
from __future__ import annotations

import torch

from ...kv_cache import KVPagePool
from ...models import LlamaForCausalLM
from ...models.mtp import MTPHead
from ..model_runner import ForwardBatch, ModelRunner
from ..sequence import Sequence
from .base import DraftProcess, StepHidden
from .vocab import DraftVocab


class MTPProposer:
    """MTP: head row i reads (t_{i+1}, h_i) and predicts t_{i+2}; its cache covers the
    rows whose target hidden state exists, one short of the sequence."""
    name = "mtp"

    def __init__(self, head: MTPHead, target: LlamaForCausalLM, pool: KVPagePool,
                 vocab_ids: torch.Tensor | None = None):
        self.head, self.target = head, target
        self.runner = ModelRunner(head, pool)
        # the head drafts through the target's final norm and lm_head
        self.vocab = DraftVocab(target.norm, target.lm_head, vocab_ids)

    @staticmethod
    def ready(seq: Sequence) -> bool:
        return seq.draft.computed == seq.num_computed == seq.num_tokens - 1 \
            and seq.draft.hidden is not None

    in_sync = ready

    def method_for(self, seq: Sequence) -> str:
        return self.name

    def drafter(self, method: str) -> "MTPProposer":
        return self

    @torch.inference_mode()
    def _run(self, seqs, next_ids: list[list[int]], starts: list[int], hidden: torch.Tensor):
        inputs, attn = self.runner.attention(ForwardBatch(next_ids, starts, [s.pages for s in seqs]))
        g = self.head(self.target, inputs.input_ids, hidden, inputs.positions, attn)
        return inputs, g

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None) -> None:
        todo = []
        for s in seqs:
            a, b = s.draft.computed, s.num_computed
            if b <= a:
                continue
            start, rows = step_hidden[s.request_id]
            if a < start:
                raise RuntimeError(f"{s.request_id}: MTP head at row {a} fell behind the target's "
                                   f"hidden states (from {start})")
            todo.append((s, a, b, rows[a - start:b - start]))
        if not todo:
            return
        inputs, g = self._run([t[0] for t in todo], [s.token_ids(a + 1, b + 1) for s, a, b, _ in todo],
                              [a for _, a, _, _ in todo], torch.cat([t[3] for t in todo]))
        last = inputs.last_rows
        for i, (s, _, b, _) in enumerate(todo):
            s.draft.computed = b
            # the first draft's logits come from this row when the head drafts (propose):
            # steps that decode plainly or draft by ngram never pay for the lm_head
            s.draft.hidden = g[last[i]] if b == s.num_tokens - 1 else None

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int,
                process: DraftProcess | None = None) -> torch.Tensor:
        drafts: list[torch.Tensor] = []
        g = torch.stack([s.draft.hidden for s in seqs])
        token = self.vocab.greedy(self.vocab.logits(g), drafts, process)
        drafts.append(token)
        for _ in range(k - 1):
            # beyond the verified tokens there is no target hidden state: feed the head's own
            _, g = self._run(seqs, [[t] for t in token.tolist()], [s.draft.computed for s in seqs], g)
            for s in seqs:
                s.draft.computed += 1
            token = self.vocab.greedy(self.vocab.logits(g), drafts, process)
            drafts.append(token)
        return torch.stack(drafts, 1)

    def after_verify(self, seqs, tokens: torch.Tensor, target_hidden: torch.Tensor,
                     starts: list[int]) -> None:
        """Re-run the head on all k+1 verified rows with the target's hidden states; rows
        past the accepted tokens are wasted work, cheaper than waiting to know where they end.
        tokens [B, k+1] (verified, -1 padded), target_hidden [B, k+1, H], starts: the
        target's cached length before verification."""
        b, width = tokens.shape
        inputs, g = self._run(seqs, tokens.clamp_min(0).tolist(), starts,
                              target_hidden.reshape(b * width, -1))
        last = torch.tensor([i * width + s.num_computed - 1 - starts[i] for i, s in enumerate(seqs)])
        for i, s in enumerate(seqs):
            s.draft.computed = s.num_computed
            s.draft.hidden = g[last[i]]
