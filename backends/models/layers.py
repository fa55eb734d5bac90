"""Decoder building blocks of the Llama family, operating on ragged token rows [N, hidden]."""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import apply_rope


class AttentionBackend(Protocol):
    """What a decoder layer needs from attention: store k/v for the batch, attend.

    The engine implements it on the paged KV cache (FlashInfer-shaped wrappers);
    training implements it as dense causal attention.
    """

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""


class LoRADelta(Protocol):
    """What a layer needs from a step's LoRA plan (backends/lora/batch.py): add each
    row's adapter delta to the base output ``y`` of a fused linear layer ("qkv", "o",
    "gate_up", "down") for inputs ``x``. A step with no adapter passes None: no work."""

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the delta (in place)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            # the fused kernel normalises in fp32 and rounds once, as HF does before it
            # multiplies by the weight in the low precision: two ops instead of eight
            return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)
        # fp32 mirrors the HF reference op for op, so greedy parity is exact
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # q, k and v fused into one GEMM: fewer kernel launches per decode step
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, attn: AttentionBackend, lora: LoRADelta | None = None) -> torch.Tensor:
        n, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.apply(self.layer, "qkv", x, qkv)
        qkv = qkv.view(n, hq + 2 * hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq:hq + hkv])
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:   # q and k rotated together: one set of ops per layer, not two
            q, k = apply_rope(qkv[:, :hq + hkv], cos, sin).split([hq, hkv], dim=1)
        out = attn.forward(self.layer, q, k, qkv[:, hq + hkv:]).reshape(n, self.q_size)
        if lora is None:
            return self.o_proj(out)
        return lora.apply(self.layer, "o", out, self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoRADelta | None = None) -> torch.Tensor:
        if lora is None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate_up = lora.apply(self.layer, "gate_up", x, self.gate_up_proj(x))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up
        return lora.apply(self.layer, "down", h, self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer)
        # a tensor-parallel rank's sum of the o and down projections' partial outputs over
        # the ranks (backends/parallel/sharding.py); None: the whole model is here
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x, cos, sin, attn: AttentionBackend, lora: LoRADelta | None = None) -> torch.Tensor:
        if self.all_reduce is not None:
            x = x + self.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, attn, lora))
            return x + self.all_reduce(self.mlp(self.post_attention_layernorm(x), lora))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)
