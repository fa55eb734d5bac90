"""Which part of a model each tensor-parallel rank computes, and cutting a loaded model
down to it (Megatron's split, as vLLM and SGLang shard Llama):

- q/k/v and gate/up are column-parallel: a rank holds its attention heads' rows of
  ``qkv_proj`` and its share of the MLP's rows of ``gate_up_proj``;
- o and down are row-parallel: a rank holds the matching input columns, so each layer's
  attention and MLP outputs are partial sums, one all-reduce each (the caller's
  ``all_reduce``, hooked into every :class:`~tandem.backends.models.layers.DecoderLayer`);
- KV heads are split when there are at least as many as ranks; with fewer, each KV head
  is replicated on ``tp / num_kv_heads`` ranks, which split its query heads;
- embeddings, norms and the lm_head stay whole on every rank (the leader computes the
  logits; a small model's vocabulary is cheap next to the all-gather a split would need);
- a LoRA adapter is cut as its projection is (:func:`projection_slices`).

>>> from tandem.backends.models.config import ModelConfig
>>> cfg = ModelConfig("llama", 32, 64, 96, 1, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
>>> [kv_heads(cfg, 4, r) for r in range(4)]        # 2 KV heads over 4 ranks: replicated
[range(0, 1), range(1, 2), range(0, 1), range(1, 2)]
>>> [q_heads(cfg, 4, r) for r in range(4)]         # each rank's query heads read its KV head
[range(0, 2), range(4, 6), range(2, 4), range(6, 8)]
>>> rank_config(cfg, 4).num_attention_heads, rank_config(cfg, 4).num_key_value_heads
(2, 1)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..models.config import ModelConfig


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming what does not divide when ``cfg``'s model cannot be split
    over ``tp`` ranks."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp}; allowed: an integer >= 1")
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads {heads}")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads {kv} (nor a divisor of it)")
    if inter % tp:
        problems.append(f"intermediate_size {inter}")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {', '.join(problems)}; "
                         f"allowed: a size that divides them")


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The head counts and MLP width one of ``tp`` ranks computes (its KV pool's shape)."""
    check_tp(cfg, tp)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=max(cfg.num_key_value_heads // tp, 1),
                               intermediate_size=cfg.intermediate_size // tp)


def kv_heads(cfg: ModelConfig, tp: int, rank: int) -> range:
    """The KV heads rank ``rank`` holds: its contiguous share, or with fewer KV heads than
    ranks one head, replicated: ranks ``[s * kv, (s + 1) * kv)`` form replica set ``s``
    and hold every head once (rank ``r`` head ``r % kv``), the layout of the transfer
    plan's ``ShardScheme(tp, replica_sets=tp // kv)`` (rdma/plan.py)."""
    kv = cfg.num_key_value_heads
    if kv >= tp:
        n = kv // tp
        return range(rank * n, (rank + 1) * n)
    return range(rank % kv, rank % kv + 1)


def q_heads(cfg: ModelConfig, tp: int, rank: int) -> range:
    """The query heads rank ``rank`` computes: those that read its KV heads (with
    replicated KV heads, a head's query group is split over its replicas)."""
    n = cfg.num_attention_heads // tp
    if cfg.num_key_value_heads >= tp:
        return range(rank * n, (rank + 1) * n)
    group = cfg.num_attention_heads // cfg.num_key_value_heads   # query heads per KV head
    start = kv_heads(cfg, tp, rank).start * group + (rank // cfg.num_key_value_heads) * n
    return range(start, start + n)


def mlp_columns(cfg: ModelConfig, tp: int, rank: int) -> range:
    n = cfg.intermediate_size // tp
    return range(rank * n, (rank + 1) * n)


def projection_slices(cfg: ModelConfig, tp: int, rank: int) -> dict[str, tuple[slice, slice]]:
    """Per projection (HF's module names), the input features and output features rank
    ``rank`` computes, in that projection's own coordinates: column-parallel q/k/v and
    gate/up keep every input and the rank's outputs, row-parallel o and down the rank's
    inputs and every output. What a LoRA adapter's A (inputs) and B (outputs) are cut to:
    its delta is then the rank's share exactly as the base's is (a row-parallel delta a
    partial sum the layer's all-reduce completes)."""
    d, q, kv, cols = cfg.head_dim, q_heads(cfg, tp, rank), kv_heads(cfg, tp, rank), mlp_columns(cfg, tp, rank)
    every, mlp = slice(None), slice(cols.start, cols.stop)
    return {"q_proj": (every, _rows(q, d)), "k_proj": (every, _rows(kv, d)), "v_proj": (every, _rows(kv, d)),
            "o_proj": (_rows(q, d), every), "gate_proj": (every, mlp), "up_proj": (every, mlp),
            "down_proj": (mlp, every)}


def _rows(heads: range, head_dim: int, offset: int = 0) -> slice:
    return slice(offset + heads.start * head_dim, offset + heads.stop * head_dim)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out.requires_grad_(False)


def shard_model_(model: nn.Module, tp: int, rank: int,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """Cut a loaded :class:`~tandem.backends.models.LlamaForCausalLM` down to rank
    ``rank``'s share, in place (before its linears are packed), and hook ``all_reduce``
    after each layer's attention and MLP. ``model.config`` stays the whole model's;
    ``model.rank_config`` becomes the rank's."""
    cfg = model.config
    local = rank_config(cfg, tp)
    d = cfg.head_dim
    q, kv, cols = q_heads(cfg, tp, rank), kv_heads(cfg, tp, rank), mlp_columns(cfg, tp, rank)
    qkv_rows = [_rows(q, d), _rows(kv, d, cfg.q_size), _rows(kv, d, cfg.q_size + cfg.kv_size)]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        attn.qkv_proj = _linear(torch.cat([w[r] for r in qkv_rows]),
                                None if b is None else torch.cat([b[r] for r in qkv_rows]))
        # a row-parallel bias is added once, by the leader, not once per rank
        o_bias = attn.o_proj.bias
        attn.o_proj = _linear(attn.o_proj.weight[:, _rows(q, d)],
                              None if o_bias is None else (o_bias if rank == 0 else torch.zeros_like(o_bias)))
        attn.num_heads, attn.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        attn.q_size, attn.kv_size = local.q_size, local.kv_size
        gate_up = mlp.gate_up_proj.weight
        up = slice(cfg.intermediate_size + cols.start, cfg.intermediate_size + cols.stop)
        mlp.gate_up_proj = _linear(torch.cat([gate_up[cols.start:cols.stop], gate_up[up]]), None)
        mlp.down_proj = _linear(mlp.down_proj.weight[:, cols.start:cols.stop], None)
        mlp.intermediate_size = local.intermediate_size
        layer.all_reduce = all_reduce
    model.rank_config = local
    return model
