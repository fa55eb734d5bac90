"""Continuations for training data with a dense KV cache: the engine's twin where its
paged attention has no kernels (CUDA without FlashInfer).

The model is the engine's own (:class:`~tandem.backends.models.LlamaForCausalLM`, the
same layers and weights); only attention differs: prompts of a batch are left-padded to
one width, each row's positions start at 0 at its first real token, and the K/V of every
layer live in one dense ``[B, H_kv, T, D]`` buffer per layer that padding columns are
masked out of. Greedy rows take the argmax, sampled rows draw from ``softmax(logits/T)``
with a seeded generator. A row that emits ``eos_id`` stops there (the EOS kept).

On a CPU the engine (:class:`~tandem.backends.engine.llm.LLM`) is faster (paged, no
padding) and gives the same greedy tokens in fp32 (tests/unit/test_chat_distill.py).

>>> model = load_model("checkpoints/demo/target", "float32")               # doctest: +SKIP
>>> generate_dense(model, [[5, 6, 7], [8]], [0.0, 0.0], new_tokens=4)      # doctest: +SKIP
[[...4 ids...], [...4 ids...]]
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from ..models import LlamaForCausalLM

log = logging.getLogger("tandem.train")


class DenseKVCache:
    """AttentionBackend over a dense per-layer K/V buffer [B, H_kv, T, D]: a forward of
    ``n`` tokens per row writes columns ``start..start+n`` and attends over ``0..start+n``,
    causally, skipping the columns ``key_valid`` [B, T] marks as padding."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 max_len: int, key_valid: torch.Tensor, dtype: torch.dtype,
                 device: torch.device):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_valid = key_valid
        self.start = 0          # columns already written
        self.n = 0              # tokens per row of the current forward
        self.mask: torch.Tensor | None = None

    def begin(self, n: int) -> None:
        """Before a forward of ``n`` tokens per row: its mask, shared by the layers."""
        self.n, s = n, self.start
        device = self.key_valid.device
        i = torch.arange(n, device=device)[:, None] + s
        j = torch.arange(s + n, device=device)[None, :]
        # a padding row attends to itself alone: no row without keys (NaN would reach V)
        self.mask = (j <= i)[None, None] & (self.key_valid[:, None, None, :s + n] | (j == i)[None, None])

    def end(self) -> None:
        self.start += self.n

    def forward(self, layer: int, q, k, v):
        b, n, s = self.k.shape[1], self.n, self.start
        q, k, v = (x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        self.k[layer, :, :, s:s + n] = k
        self.v[layer, :, :, s:s + n] = v
        keys, values = self.k[layer, :, :, :s + n], self.v[layer, :, :, :s + n]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, out.shape[1], out.shape[3])


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: ids [B, P] and the valid mask [B, P].

    >>> ids, valid = left_pad([[5, 6], [7]], pad_id=0)
    >>> ids.tolist(), valid.int().tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, width - len(p):] = True
    return ids, valid


def pick_tokens(logits: torch.Tensor, temperatures: torch.Tensor,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next ids [B] from fp32 logits [B, V]: argmax where the temperature is 0, a draw
    from ``softmax(logits / T)`` elsewhere."""
    greedy = logits.argmax(-1)
    sampled_rows = temperatures > 0
    if not bool(sampled_rows.any()):
        return greedy
    t = torch.where(sampled_rows, temperatures, torch.ones_like(temperatures))
    probs = (logits / t[:, None]).softmax(-1)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.where(sampled_rows, drawn, greedy)


@torch.inference_mode()
def generate_batch(model: LlamaForCausalLM, prompts: list[list[int]], temperatures: list[float],
                   new_tokens: int, eos_id: int | None = None, seed: int = 0,
                   pad_id: int = 0) -> list[list[int]]:
    """Continuations of one batch of prompts (at most ``new_tokens`` each; a row stops
    after ``eos_id``)."""
    cfg, w = model.config, model.embed_tokens.weight
    device = w.device
    ids, valid = left_pad(prompts, pad_id)
    b, p = ids.shape
    key_valid = torch.ones(b, p + new_tokens, dtype=torch.bool)
    key_valid[:, :p] = valid
    key_valid = key_valid.to(device)
    cache = DenseKVCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, cfg.head_dim,
                         p + new_tokens, key_valid, w.dtype, device)
    temps = torch.tensor(temperatures, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    offset = (~valid).sum(1).to(device)                   # padding before each row's prompt
    positions = (torch.arange(p, device=device)[None, :] - offset[:, None]).clamp(min=0)
    x, out = ids.to(device), []
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for _ in range(new_tokens):
        cache.begin(x.shape[1])
        hidden = model(x.reshape(-1), positions.reshape(-1), cache).view(b, x.shape[1], -1)
        cache.end()
        nxt = pick_tokens(model.compute_logits(hidden[:, -1]), temps, gen)
        out.append(torch.where(done, torch.full_like(nxt, -1), nxt))
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                break
        x, positions = nxt[:, None], positions[:, -1:] + 1
    rows = torch.stack(out, 1).cpu().tolist()
    return [[t for t in r if t >= 0] for r in rows]


def generate_dense(model: LlamaForCausalLM, prompts: list[list[int]], temperatures: list[float],
                   new_tokens: int, eos_id: int | None = None, seed: int = 0, batch: int = 256,
                   pad_id: int = 0) -> list[list[int]]:
    """Continuations of ``prompts`` in batches of ``batch`` (rows sorted by length inside,
    so little padding; returned in the prompts' order)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    t0, made = time.monotonic(), 0
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        conts = generate_batch(model, [prompts[i] for i in idx], [temperatures[i] for i in idx],
                               new_tokens, eos_id, seed * 1_000_003 + a, pad_id)
        for i, c in zip(idx, conts):
            out[i] = c
        made += sum(map(len, conts))
        log.info("dense generation: %d/%d prompts continued (%.0f generated tok/s)",
                 min(a + batch, len(order)), len(order), made / (time.monotonic() - t0))
    return out
