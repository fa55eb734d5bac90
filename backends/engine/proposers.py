"""Draft proposers: a small draft model, or an MTP head on the target's hidden states.

Both keep, per sequence, ``draft.computed`` (their cached length) and the logits their
last run left for the next step's first draft token, and follow one protocol:

- ``catch_up(seqs, step_hidden)`` after a plain (prefill or mixed) target step;
- ``propose(seqs, k, process)`` -> ``[B, k]`` greedy draft tokens (``process``, when
  given, changes each step's draft logits in place first: the requests' logits controls);
- ``after_verify(seqs, tokens, target_hidden, starts)`` once the target has verified.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..kv_cache import KVPagePool
from ..models import LlamaForCausalLM, load_model
from ..models.mtp import MTPHead, load_mtp_head
from ..models.packed_linear import PackedLinear, packing_supported
from ..speculative.config import SpeculativeConfig
from ..speculative.draft_vocab import load_frequent_ids
from .model_runner import ForwardBatch, ModelRunner
from .sequence import Sequence

# per request id: (first target position computed this step, hidden rows [n, H])
StepHidden = dict[str, tuple[int, torch.Tensor]]
# (draft logits [B, V], the drafts so far [B, j] or None) -> None, in place
DraftProcess = Callable[[torch.Tensor, "torch.Tensor | None"], None]


class DraftVocab:
    """A proposer's output layer: final norm and lm_head over the whole vocabulary, or
    over its ``ids`` only (the most frequent tokens: FR-Spec), with drafts mapped back."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, ids: torch.Tensor | None = None):
        self.norm, self.ids, self.head = norm, ids, lm_head
        if ids is not None:
            sub = nn.Linear(lm_head.in_features, len(ids), bias=False,
                            device=lm_head.weight.device, dtype=lm_head.weight.dtype)
            sub.weight = nn.Parameter(lm_head.weight.detach()[ids.to(lm_head.weight.device)].clone(),
                                      requires_grad=False)
            self.head = PackedLinear(sub) if packing_supported(sub.weight) else sub
            self.ids = ids.to(lm_head.weight.device)

    @property
    def full(self) -> bool:
        return self.ids is None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the scored tokens of pre-norm ``hidden`` rows."""
        return self.head(self.norm(hidden)).float()

    def greedy(self, logits: torch.Tensor, drafts: list[torch.Tensor],
               process: DraftProcess | None) -> torch.Tensor:
        """The next draft token per row: the argmax, of the processed logits when the batch
        uses logits controls (so drafts agree with a controlled target more often; controls
        need every token's logit, so a subset vocabulary drafts without them)."""
        if process is not None and self.full:
            process(logits, torch.stack(drafts, 1) if drafts else None)
        index = logits.argmax(-1)
        return index if self.ids is None else self.ids[index]


def draft_vocab_ids(spec: SpeculativeConfig, vocab_size: int) -> torch.Tensor | None:
    """The token ids the proposer scores (``spec.draft_vocab_size`` of them), or None."""
    if spec.draft_vocab_size is None:
        return None
    model_dir = spec.draft_model if spec.method == "draft_target" else spec.mtp_head
    return load_frequent_ids(model_dir, spec.draft_vocab_size, vocab_size)


def load_proposer_model(spec: SpeculativeConfig, target: LlamaForCausalLM, dtype: str,
                        device: str) -> LlamaForCausalLM | MTPHead:
    """The draft model or the MTP head ``spec`` names, checked against ``target``."""
    if spec.method == "draft_target":
        draft = load_model(spec.draft_model, dtype, device)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft_model: vocab_size {draft.config.vocab_size} differs from "
                             f"the target's {target.config.vocab_size}")
        return draft
    if spec.method == "mtp":
        return load_mtp_head(spec.mtp_head, target)
    raise ValueError(f"no proposer model for speculative method {spec.method!r}")


def make_proposer(model: LlamaForCausalLM | MTPHead, target: LlamaForCausalLM, pool: KVPagePool,
                  vocab_ids: torch.Tensor | None = None):
    """``vocab_ids``: score only these tokens when drafting (see :class:`DraftVocab`)."""
    if isinstance(model, MTPHead):
        return MTPProposer(model, target, pool, vocab_ids)
    return DraftModelProposer(model, pool, vocab_ids)


class DraftModelProposer:
    """Draft-target: the draft has seen every token of the sequence (its KV is one
    token ahead of the target's) and carries the logits for the next one."""

    def __init__(self, draft: LlamaForCausalLM, pool: KVPagePool,
                 vocab_ids: torch.Tensor | None = None):
        self.runner = ModelRunner(draft, pool)
        self.vocab = DraftVocab(draft.norm, draft.lm_head, vocab_ids)
        # graphed (GPU) or compiled (CPU) decode steps, when the engine has them
        self.fast_decode = None

    @staticmethod
    def ready(seq: Sequence) -> bool:
        return seq.draft.computed == seq.num_tokens and seq.draft.logits is not None

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None) -> None:
        """Feed the draft the tokens it has not seen, up to one past the target's cache."""
        todo = [(s, s.draft.computed, min(s.num_tokens, s.num_computed + 1)) for s in seqs]
        todo = [(s, a, b) for s, a, b in todo if b > a]
        if not todo:
            return
        batch = ForwardBatch([s.token_ids(a, b) for s, a, b in todo], [a for _, a, _ in todo],
                             [s.pages for s, _, _ in todo])
        inputs, hidden = self.runner.forward(batch)
        logits = self.vocab.logits(hidden[inputs.last_rows])
        for i, (s, _, b) in enumerate(todo):
            s.draft.computed = b
            s.draft.logits = logits[i] if b == s.num_tokens else None

    def propose(self, seqs: list[Sequence], k: int,
                process: DraftProcess | None = None) -> torch.Tensor:
        drafts: list[torch.Tensor] = []
        token = self.vocab.greedy(torch.stack([s.draft.logits for s in seqs]), drafts, process)
        drafts.append(token)
        for _ in range(k - 1):
            batch = ForwardBatch([[t] for t in token.tolist()], [s.draft.computed for s in seqs],
                                 [s.pages for s in seqs])
            hidden = None if self.fast_decode is None else self.fast_decode.forward(batch)
            if hidden is None:
                _, hidden = self.runner.forward(batch)
            for s in seqs:
                s.draft.computed += 1
            token = self.vocab.greedy(self.vocab.logits(hidden), drafts, process)
            drafts.append(token)
        return torch.stack(drafts, 1)

    def after_verify(self, seqs, tokens, target_hidden, starts) -> None:
        # the draft's KV stays valid only as far as its tokens were accepted
        for s in seqs:
            s.draft.computed = min(s.draft.computed, s.num_computed)
            s.draft.logits = None
        self.catch_up(seqs)


class MTPProposer:
    """MTP: head row i reads (t_{i+1}, h_i) and predicts t_{i+2}; its cache covers the
    rows whose target hidden state exists, one short of the sequence."""

    def __init__(self, head: MTPHead, target: LlamaForCausalLM, pool: KVPagePool,
                 vocab_ids: torch.Tensor | None = None):
        self.head, self.target = head, target
        self.runner = ModelRunner(head, pool)
        # the head drafts through the target's final norm and lm_head
        self.vocab = DraftVocab(target.norm, target.lm_head, vocab_ids)

    @staticmethod
    def ready(seq: Sequence) -> bool:
        return seq.draft.computed == seq.num_computed == seq.num_tokens - 1 \
            and seq.draft.logits is not None

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
        logits = self.vocab.logits(g[last])
        for i, (s, _, b, _) in enumerate(todo):
            s.draft.computed = b
            done = b == s.num_tokens - 1
            s.draft.logits = logits[i] if done else None
            s.draft.hidden = g[last[i]] if done else None

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int,
                process: DraftProcess | None = None) -> torch.Tensor:
        drafts: list[torch.Tensor] = []
        token = self.vocab.greedy(torch.stack([s.draft.logits for s in seqs]), drafts, process)
        g = torch.stack([s.draft.hidden for s in seqs])
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
        logits = self.vocab.logits(g[last])
        for i, s in enumerate(seqs):
            s.draft.computed = s.num_computed
            s.draft.logits, s.draft.hidden = logits[i], g[last[i]]


class ProposerPrefill:
    """The prefill side of disaggregated speculation: fills the proposer's KV for the
    chunk the target just computed, so that the decoder can speculate from its first
    step without running a prefill of its own (the KV travels with the target's)."""

    def __init__(self, model: LlamaForCausalLM | MTPHead, target: LlamaForCausalLM,
                 pool: KVPagePool):
        self.model, self.target = model, target
        self.runner = ModelRunner(model, pool)

    @property
    def pool(self) -> KVPagePool:
        return self.runner.pool

    @property
    def reads_next_token(self) -> bool:
        """The MTP head's row i reads t_{i+1}: its chunks need the tokens one ahead."""
        return isinstance(self.model, MTPHead)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, next_ids: list[list[int]] | None, target_hidden: torch.Tensor,
            on_layer_done=None) -> None:
        """``batch``: the target's chunks; ``next_ids``: each chunk's tokens shifted left by
        one (the MTP head's row i reads t_{i+1}); ``target_hidden``: the target's pre-norm
        hidden rows of ``batch``."""
        if isinstance(self.model, MTPHead):
            shifted = ForwardBatch(next_ids, batch.starts, batch.page_lists)
            inputs, attn = self.runner.attention(shifted, on_layer_done)
            self.model(self.target, inputs.input_ids, target_hidden, inputs.positions, attn)
        else:
            self.runner.forward(batch, on_layer_done)
