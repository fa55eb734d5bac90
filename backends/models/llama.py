"""Llama-family causal LM over ragged token rows; attention is supplied by the caller."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import AttentionBackend, DecoderLayer, LoRADelta, RMSNorm
from .rope import RotaryTable


class LlamaForCausalLM(nn.Module):
    """Target, draft (fewer layers) and the base of the MTP head share this class.

    ``forward`` takes flattened tokens of a whole batch (``input_ids`` [N],
    ``positions`` [N]) and an :class:`AttentionBackend` that knows where each
    token's KV lives; it returns the final hidden states before the last norm.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # the head counts and MLP width this process computes: a tensor-parallel rank's
        # share (backends/parallel/sharding.py), else the whole model's
        self.rank_config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: RotaryTable | None = None

    def rotary_table(self) -> RotaryTable:
        w = self.embed_tokens.weight
        if self.rotary is None or self.rotary.cos.device != w.device or self.rotary.dtype != w.dtype:
            self.rotary = RotaryTable(self.config, w.device, w.dtype)
        return self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend, lora: LoRADelta | None = None) -> torch.Tensor:
        """``lora``: the step's adapter plan (backends/lora), None when no row uses one."""
        cos, sin = self.rotary_table().lookup(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn, lora)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the given (pre-norm) hidden rows."""
        return self.lm_head(self.norm(hidden)).float()


class DenseCausalAttention:
    """Plain causal attention over a padded [batch, seq] block: the training path."""

    def __init__(self, batch: int, seq: int):
        self.batch, self.seq = batch, seq

    def forward(self, layer, q, k, v):
        b, t = self.batch, self.seq
        q, k, v = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, out.shape[1], out.shape[3])


def forward_dense(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Hidden states [batch, seq, hidden] (pre-norm) of a [batch, seq] id block."""
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).repeat(b)
    hidden = model(input_ids.reshape(-1), positions, DenseCausalAttention(b, t))
    return hidden.view(b, t, -1)
