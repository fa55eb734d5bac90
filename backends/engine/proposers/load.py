"""Loading a speculative method's proposer model and building its proposer."""
from __future__ import annotations

from typing import Callable

import torch

from ...kv_cache import KVPagePool
from ...models import LlamaForCausalLM, load_model
from ...models.mtp import MTPHead, load_mtp_head
from ...speculative.config import SpeculativeConfig
from ..config import EngineConfig
from ..kv_pool import check_pool_fits, kv_page_pool
from .auto import AutoProposer
from .base import Proposer
from .draft import DraftModelProposer
from .mtp import MTPProposer
from .ngram import NgramProposer
from .vocab import draft_vocab_ids


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


def build_proposer(spec: SpeculativeConfig, config: EngineConfig, target: LlamaForCausalLM,
                   num_pages: int, pool: KVPagePool | None,
                   use_ngram: Callable[[str], bool]) -> Proposer:
    """The proposer ``spec`` asks for. A model proposer's KV pages share the target's page
    ids (one allocation serves both models): on ``pool`` when given (an external pool,
    checked), else on a pool of ``num_pages`` made here. ``use_ngram(request_id)``:
    whether ``--spec auto`` still drafts by prompt lookup for that request."""
    ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
    if not spec.has_kv:
        return ngram
    model = load_proposer_model(spec, target, config.dtype, config.device)
    dtype = target.embed_tokens.weight.dtype
    if pool is None:
        pool = kv_page_pool(config, model.config, num_pages, dtype)
    else:
        check_pool_fits(config, pool, model.config, dtype)
        if pool.num_pages != num_pages:
            raise ValueError(f"proposer_kv_pool has {pool.num_pages} pages, the target's "
                             f"{num_pages}: they share page ids")
    # adaptive: the proposer runs only on steps it drafts in (after plain and ngram steps
    # it catches up when it drafts next)
    proposer = make_proposer(model, target, pool, draft_vocab_ids(spec, target.config.vocab_size),
                             spec.adaptive)
    return AutoProposer(ngram, proposer, use_ngram) if spec.auto else proposer
