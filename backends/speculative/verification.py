"""From target logits and greedy drafts to verified tokens, per request settings."""
from __future__ import annotations

import torch

from ..engine.params import SamplingParams
from ..engine.sampler import filtered_probs
from .verify import chain_speculative_sampling


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, n, V] logits -> the distributions each request samples from: one-hot argmax
    for greedy requests, temperature/top-k/top-p filtered otherwise (as plain sampling)."""
    b, n, v = logits.shape
    probs = torch.nn.functional.one_hot(logits.argmax(-1), v).to(logits.dtype)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits[rows].reshape(len(rows) * n, v)
        rep = lambda f, dt: torch.tensor([f(params[i]) for i in rows for _ in range(n)], dtype=dt)
        probs[rows] = filtered_probs(sub, rep(lambda p: p.temperature, sub.dtype),
                                     rep(lambda p: p.top_k, torch.long),
                                     rep(lambda p: p.top_p, sub.dtype)).view(len(rows), n, v)
    return probs


def verify_drafts(logits: torch.Tensor, drafts: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> tuple[torch.Tensor, list[int]]:
    """Verify greedy drafts [B, k] against target logits [B, k+1, V].

    Returns the verified tokens [B, k+1] (-1 padded) and the accepted draft count per
    request. Greedy drafts are one-hot draft distributions; a seeded request is verified
    with its own generator so its output does not depend on the rest of the batch."""
    b, k = drafts.shape
    out = torch.empty(b, k + 1, dtype=torch.int32)
    emitted = torch.empty(b, dtype=torch.int32)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        # one-hot p and q: the rejection sampler reduces to "keep drafts while they equal
        # the target's argmax, then the argmax" -- the same tokens, without vocab-sized work
        best = logits[greedy].argmax(-1)
        n = (drafts[greedy] == best[:, :k]).int().cumprod(1).sum(1)
        keep = torch.arange(k + 1)[None, :] <= n[:, None]
        out[greedy] = torch.where(keep, best, -1).to(torch.int32)
        emitted[greedy] = n.to(torch.int32)
    if len(greedy) == b:
        return out, emitted.tolist()
    p = target_probs(logits, params)
    q = torch.nn.functional.one_hot(drafts, logits.shape[-1]).to(p.dtype)
    shared = [i for i, g in enumerate(generators) if g is None and not params[i].greedy]
    if shared:
        out[shared], _, emitted[shared] = chain_speculative_sampling(q[shared], drafts[shared], p[shared])
    for i, g in enumerate(generators):
        if g is not None and not params[i].greedy:
            o, _, e = chain_speculative_sampling(q[i:i + 1], drafts[i:i + 1], p[i:i + 1], generator=g)
            out[i], emitted[i] = o[0], e[0]
    return out, emitted.tolist()
