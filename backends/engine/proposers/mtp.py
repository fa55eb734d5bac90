"""MTP speculation's proposer: a multi-token-prediction head that drafts from the
target's hidden states, through the target's own norm and lm_head."""
from __future__ import annotations

import torch

from ...kv_cache import KVPagePool
from ...models import LlamaForCausalLM
from ...models.mtp import MTPHead
from ..model_runner import ForwardBatch, ModelRunner
from ..sequence import Sequence
from .base import MAX_LAG, DraftProcess, StepHidden
from .vocab import DraftVocab


class MTPProposer:
    """MTP: head row i reads (t_{i+1}, h_i) and predicts t_{i+2}; its cache covers the
    rows whose target hidden state exists, one short of the sequence.

    ``lazy`` (adaptive speculation): after a step it did not draft in, the head keeps the
    target's hidden rows instead of running on them, and catches up on all of them at
    once when it drafts next (or :data:`~.base.MAX_LAG` rows wait): steps that decode plainly or
    draft by ngram cost no head run. Its KV covers every committed row before it drafts."""
    name = "mtp"
    fallback_method = None

    def __init__(self, head: MTPHead, target: LlamaForCausalLM, pool: KVPagePool,
                 vocab_ids: torch.Tensor | None = None, lazy: bool = False):
        if getattr(head, "fuse_layers", None) is not None:    # it would be fed h_i in place of fused features
            raise ValueError(f"mtp_head: a head with fuse_layers {list(head.fuse_layers)} "
                             "(EAGLE-3-style) is for offline evaluation only; the engine feeds "
                             "the MTP proposer the last hidden state, not those layers' outputs")
        self.head, self.target = head, target
        self.runner = ModelRunner(head, pool)
        # the head drafts through the target's final norm and lm_head
        self.vocab = DraftVocab(target.norm, target.lm_head, vocab_ids)
        self.lazy = lazy
        # per request id: [first row, the target's hidden rows from it, their count] not yet run
        self._pending: dict[str, list] = {}

    @staticmethod
    def ready(seq: Sequence) -> bool:
        return seq.draft.computed == seq.num_computed == seq.num_tokens - 1 \
            and seq.draft.hidden is not None

    def in_sync(self, seq: Sequence) -> bool:
        """It can draft for ``seq`` now, after catching up on the rows it keeps."""
        if seq.num_computed != seq.num_tokens - 1:
            return False
        held = self._pending.get(seq.request_id)
        if held is None:
            return self.ready(seq)
        first, _, count = held
        return first == seq.draft.computed and first + count == seq.num_computed

    def method_for(self, seq: Sequence) -> str:
        return self.name

    def drafter(self, method: str) -> "MTPProposer":
        return self

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def _keep(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """Keep the target's hidden rows ``start..start+len(rows)`` (of which the head
        lacks those from its cached length on) for a later catch-up."""
        held = self._pending.get(seq.request_id)
        if held is not None and held[0] != seq.draft.computed:
            held = None       # rows of an earlier life of the sequence (preempted)
        end = seq.draft.computed if held is None else held[0] + held[2]
        if end < start:
            raise RuntimeError(f"{seq.request_id}: MTP head at row {end} fell behind the target's "
                               f"hidden states (from {start})")
        new = rows[end - start:seq.num_computed - start]
        if held is None:
            held = self._pending[seq.request_id] = [end, [], 0]
        held[1].append(new)
        held[2] += len(new)
        seq.draft.hidden = None     # not ready until it catches up

    def flush(self, seqs: list[Sequence], max_lag: int = 0) -> None:
        """Run the head on the rows kept for ``seqs`` (those with more than ``max_lag``)."""
        todo = {}
        for s in seqs:
            held = self._pending.get(s.request_id)
            if held is not None and held[2] > max_lag:
                del self._pending[s.request_id]
                todo[s.request_id] = (held[0], torch.cat(held[1]))
        if todo:
            self._catch_up([s for s in seqs if s.request_id in todo], todo)

    @staticmethod
    def plain_decode_runner() -> None:
        return None     # its drafting steps read the step before's hidden state: not plain decode

    def use_fast_decode(self, steps) -> None:
        raise ValueError("an MTP head has no plain decode steps to run fast")

    @torch.inference_mode()
    def _run(self, seqs, next_ids: list[list[int]], starts: list[int], hidden: torch.Tensor):
        inputs, attn = self.runner.attention(ForwardBatch(next_ids, starts, [s.pages for s in seqs]))
        g = self.head(self.target, inputs.input_ids, hidden, inputs.positions, attn)
        return inputs, g

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None,
                 max_lag: int = MAX_LAG) -> None:
        if not self.lazy:
            return self._catch_up(seqs, step_hidden)
        chunks = []
        for s in seqs:
            if s.num_computed > s.draft.computed:
                start, rows = step_hidden[s.request_id]
                self._keep(s, start, rows)
                if len(rows) > 1:        # a prompt's chunk: its KV is wanted (prefix cache)
                    chunks.append(s)
        self.flush(chunks)
        self.flush(seqs, max_lag)

    def _catch_up(self, seqs: list[Sequence], step_hidden: StepHidden) -> None:
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
        self.flush(seqs)
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
        target's cached length before verification. Lazy: the verified rows are kept
        for the next catch-up instead (rows past a draft's start are rewritten then)."""
        if self.lazy:
            for i, s in enumerate(seqs):
                s.draft.computed = min(s.draft.computed, starts[i])
                self._keep(s, starts[i], target_hidden[i])
            self.flush(seqs, MAX_LAG)
            return
        b, width = tokens.shape
        inputs, g = self._run(seqs, tokens.clamp_min(0).tolist(), starts,
                              target_hidden.reshape(b * width, -1))
        last = torch.tensor([i * width + s.num_computed - 1 - starts[i] for i, s in enumerate(seqs)])
        for i, s in enumerate(seqs):
            s.draft.computed = s.num_computed
            s.draft.hidden = g[last[i]]
