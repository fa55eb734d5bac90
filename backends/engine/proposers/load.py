"""Loading a speculative method's proposer model and building its proposer."""
from __future__ import annotations

import torch

from ...kv_cache import KVPagePool
from ...models import LlamaForCausalLM, load_model
from ...models.mtp import MTPHead, load_mtp_head
from ...speculative.config import SpeculativeConfig
from .base import Proposer
from .draft import DraftModelProposer
from .mtp import MTPProposer


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
                  vocab_ids: torch.Tensor | None = None, lazy: bool = False) -> Proposer:
    """``vocab_ids``: score only these tokens when drafting (see :class:`~.vocab.DraftVocab`);
    ``lazy``: the proposer catches up only when it drafts (see :class:`~.mtp.MTPProposer`)."""
    if isinstance(model, MTPHead):
        return MTPProposer(model, target, pool, vocab_ids, lazy)
    return DraftModelProposer(model, pool, vocab_ids, lazy)
