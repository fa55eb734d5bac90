"""A proposer's output layer (shared by the draft model and the MTP head): the whole
vocabulary, or only its most frequent tokens (FR-Spec)."""
from __future__ import annotations

import torch
from torch import nn

from ...models.packed_linear import PackedLinear, packing_supported
from ...speculative.config import SpeculativeConfig
from ...speculative.draft_vocab import load_frequent_ids
from .base import DraftProcess


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
