"""Small decode batches on the CPU through ``torch.compile``: the CPU's CUDA graph.

At batch 1 a decode step of the demo target is mostly per-operator overhead; inductor
fuses the norms, rotary and residual arithmetic of each layer into a few C++ kernels and
runs the whole step (KV append, page gather, attention included) as one call:
``tandem bench compile`` measures it ~1.6x faster than the eager step at batch 1 and
slower from batch 4 on, so only the sizes in ``COMPILED_SIZES`` are compiled. The step
has static shapes except the page count (a dynamic dimension, so a growing context does
not recompile); padding rows and padding pages point at the engine's scratch page and are
masked out. Off by default (``EngineConfig.compile``): each size compiles for ~10 s on
first use, and fused kernels round differently from the eager ones (bf16 greedy text can
differ from the eager engine's at near-ties; fp32 agrees to ~1e-6).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_cache import KVPagePool, pages_needed
from .graph_runner import pad_decode_batch, padded_size
from .model_runner import ForwardBatch
from .request_limits import MAX_LOOKAHEAD_SLOTS

COMPILED_SIZES = [1, 2]


def _utf8_locale() -> None:
    """Inductor reads its UTF-8 code templates in the locale's encoding; an embedded
    interpreter without a locale (Triton's Python-backend stubs) has ASCII."""
    import locale
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
            try:
                locale.setlocale(locale.LC_CTYPE, name)
                return
            except locale.Error:
                continue


def decode_step(model, page_size: int):
    """The traceable step over an HND pool ``kv`` [layers, pages, 2, H, page_size, D]:
    ``(kv, ids, positions, rows, mask)`` -> (pre-norm hidden [B, hidden], the new token's
    K/V [B, layers, 2, H, D]). The pool is only read: each layer attends to its pages plus
    the new token's own K/V, which the caller writes into the pool after the step (one
    write for all layers; a write inside the graph would copy the whole pool)."""
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rot = model.rotary_table()

    def linear(module, x):   # the weight itself, so that inductor freezes and packs it
        return F.linear(x, module.weight, module.bias)

    def step(kv, ids, positions, rows, mask):
        b = ids.shape[0]
        cos, sin = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)
        x = model.embed_tokens(ids)
        new_kv = []
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = linear(attn.qkv_proj, layer.input_layernorm(x)).view(b, hq + 2 * hkv, d)
            qk = qkv[:, :hq + hkv]
            if attn.q_norm is not None:     # Qwen3
                qk = torch.cat((attn.q_norm(qk[:, :hq]), attn.k_norm(qk[:, hq:])), 1)
            q, k = (qk * cos + qk.roll(d // 2, -1) * sin).split([hq, hkv], 1)
            v = qkv[:, hq + hkv:]
            new_kv.append(torch.stack((k, v), 1))
            cached = kv[i].reshape(-1, page_size * d).index_select(0, rows)
            k_old, v_old = cached.view(2, hkv, b, -1, d).transpose(1, 2).to(q.dtype)
            k_all = torch.cat((k_old, k.unsqueeze(2)), 2)           # [B, H, L + 1, D]
            v_all = torch.cat((v_old, v.unsqueeze(2)), 2)
            o = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), k_all, v_all,
                                               attn_mask=mask)
            x = x + linear(attn.o_proj, o.reshape(b, hq * d))
            gate, up = linear(mlp.gate_up_proj, layer.post_attention_layernorm(x)).chunk(2, -1)
            x = x + linear(mlp.down_proj, F.silu(gate) * up)
        return x, torch.stack(new_kv, 1)
    return step


def step_inputs(batch: ForwardBatch, page_size: int, num_kv_heads: int, dtype,
                scratch_page: int) -> tuple[torch.Tensor, ...]:
    """``(ids, positions, rows, mask)`` of the step for a (padded) decode batch, and where
    the new tokens' K/V go (``page``, ``slot``). Each sequence's pages up to its new token
    are padded with the scratch page to a power of two; the mask hides the padding and
    the new token's slot (the step attends to its K/V directly: the last column).

    >>> ids, pos, rows, mask, page, slot = step_inputs(
    ...     ForwardBatch([[7]], [17], [[3, 4]]), 16, 1, torch.float32, 9)
    >>> page.tolist(), slot.tolist(), rows.tolist(), mask.shape, int((mask == 0).sum())
    ([4], [1], [6, 8, 7, 9], torch.Size([1, 1, 1, 33]), 18)
    """
    ends = [s + 1 for s in batch.starts]
    need = [pages_needed(e, page_size) for e in ends]
    width = 1 << (max(need) - 1).bit_length()
    table = torch.tensor([pages[:n] + [scratch_page] * (width - n)
                          for pages, n in zip(batch.page_lists, need)])          # [B, P]
    rows = (table[None, None] * 2 + torch.arange(2)[:, None, None, None]) * num_kv_heads \
        + torch.arange(num_kv_heads)[None, :, None, None]                       # [2, H, B, P]
    mask = torch.zeros(len(ends), 1, 1, width * page_size + 1, dtype=dtype)
    for b, start in enumerate(batch.starts):
        mask[b, ..., start:-1] = float("-inf")        # the cache holds positions < start
    starts = torch.tensor(batch.starts)
    page = table[torch.arange(len(ends)), starts // page_size]
    return (torch.tensor([t[0] for t in batch.token_ids]), starts, rows.reshape(-1), mask,
            page, starts % page_size)


class CompiledDecode:
    """Decode batches of up to ``max(COMPILED_SIZES)`` sequences through one compiled
    step per size (the engine's ``decode_graphs`` slot: ``forward(batch)`` -> hidden, or
    None for a batch it does not take: larger, not plain decode, or an NHD pool)."""

    def __init__(self, model, pool: KVPagePool, scratch_page: int):
        _utf8_locale()
        import torch._inductor.config as inductor_config
        inductor_config.freezing = True      # weights become constants inductor packs
        self.pool, self.scratch_page = pool, scratch_page
        cfg = model.config
        self.num_kv_heads = cfg.num_key_value_heads
        self.kv = pool.kv.view(cfg.num_hidden_layers, pool.num_pages, 2, cfg.num_key_value_heads,
                               pool.page_size, cfg.head_dim)
        self.dtype = next(model.parameters()).dtype
        # static shapes: one graph per (batch size, power-of-two page count); dynamic
        # shapes measured far slower here
        pages_max = pages_needed(cfg.max_position_embeddings + MAX_LOOKAHEAD_SLOTS, pool.page_size)
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, len(COMPILED_SIZES) * pages_max.bit_length() + 2)
        self.step = torch.compile(decode_step(model, pool.page_size), dynamic=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        n = len(batch.token_ids)
        size = padded_size(n, COMPILED_SIZES)
        if size is None or self.pool.kv_layout != "HND" or any(len(t) != 1 for t in batch.token_ids):
            return None
        inputs = step_inputs(pad_decode_batch(batch, size, self.scratch_page), self.pool.page_size,
                             self.num_kv_heads, self.dtype, self.scratch_page)
        ids, positions, rows, mask, page, slot = inputs
        hidden, new_kv = self.step(self.kv, ids, positions, rows, mask)
        self.kv[:, page, :, :, slot] = new_kv.to(self.kv.dtype)   # [B, layers, 2, H, D]
        return hidden[:n]
