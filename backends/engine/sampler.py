"""Token sampling: temperature, top-k, top-p, per-request seeds. Pure tensor maths."""
from __future__ import annotations

import torch

from .params import SamplingParams


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, per row.

    logits [B, V] fp32; temperature [B] (> 0); top_k [B] int (0 = off); top_p [B] in (0, 1].
    Speculative verification applies the same function to target and draft alike.
    """
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches p (the top token always stays)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(-1)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row. Greedy rows take the argmax; the others draw from their
    filtered distribution with their own generator, so a seeded request gets the same
    tokens whatever else is in the batch."""
    tokens = logits.argmax(-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    sub = logits[rows]
    probs = filtered_probs(
        sub,
        torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype),
        torch.tensor([params[i].top_k for i in rows]),
        torch.tensor([params[i].top_p for i in rows], dtype=sub.dtype),
    )
    for j, i in enumerate(rows):
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return tokens
