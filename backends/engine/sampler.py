"""From logits to tokens, per request settings: plain sampling (temperature, top-k,
top-p, seeds) and the verification of greedy drafts. Pure tensor maths."""
from __future__ import annotations

import torch

from ..speculative.verify import chain_speculative_sampling
from .params import SamplingParams


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Logits after temperature, top-k and top-p, per row (filtered tokens at -inf).

    logits [B, V] fp32; temperature [B] (> 0); top_k [B] int (0 = off); top_p [B] in (0, 1].
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
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, per row (see ``filtered_logits``).
    Speculative verification applies the same function to target and draft alike."""
    return filtered_logits(logits, temperature, top_k, top_p).softmax(-1)


def _per_row(params: list[SamplingParams], n: int, like: torch.Tensor):
    """Each request's temperature, top-k and top-p, repeated over its ``n`` positions,
    on the device of ``like``."""
    row = lambda name, dtype: torch.tensor([getattr(p, name) for p in params for _ in range(n)],
                                           dtype=dtype, device=like.device)
    return row("temperature", like.dtype), row("top_k", torch.long), row("top_p", like.dtype)


def request_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, n, V] logits of non-greedy requests -> each request's filtered distribution
    at each of its ``n`` positions."""
    r, n, v = logits.shape
    flat = logits.reshape(r * n, v)
    return filtered_probs(flat, *_per_row(params, n, flat)).view(r, n, v)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row. Greedy rows take the argmax; the others draw from their
    filtered distribution with their own generator, so a seeded request gets the same
    tokens whatever else is in the batch."""
    tokens = logits.argmax(-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    probs = request_probs(logits[rows, None], [params[i] for i in rows])[:, 0]
    check_distributions(probs)
    for j, i in enumerate(rows):
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   params: list[SamplingParams]) -> list[float]:
    """The log-probability of ``tokens[i]`` under the distribution row ``i`` samples
    from: the log-softmax of the logits after temperature, top-k and top-p, or for a
    greedy request of the logits themselves (temperature 1, as vLLM reports for
    temperature 0). ``logits`` [N, V] are the processed logits (controls applied).

    >>> token_logprobs(torch.log(torch.tensor([[0.5, 0.25, 0.25]])), [1],
    ...                [SamplingParams(temperature=0)])
    [-1.3862943649291992]
    """
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        logits = logits.clone()
        logits[rows] = filtered_logits(logits[rows], *_per_row([params[i] for i in rows], 1,
                                                               logits))
    picked = logits.log_softmax(-1).gather(
        -1, torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None])
    return picked[:, 0].tolist()


def check_distributions(probs: torch.Tensor) -> None:
    """NaN, inf or an all-zero row never reach ``multinomial`` (non-finite logits, e.g. a
    numerically broken model output): the step raises, and the engine ends only the
    request whose row it is."""
    ok = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten().tolist()
        raise FloatingPointError(f"the sampling distribution of row(s) {bad} is not finite "
                                 "(the model's logits hold NaN or inf)")


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, n, V] logits -> the distributions each request samples from: one-hot argmax
    for greedy requests, temperature/top-k/top-p filtered otherwise (as plain sampling)."""
    probs = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs[rows] = request_probs(logits[rows], [params[i] for i in rows])
    return probs

def verify_drafts(logits: torch.Tensor, drafts: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> tuple[torch.Tensor, list[int]]:
    """Verify greedy drafts [B, k] against target logits [B, k+1, V].

    Returns the verified tokens [B, k+1] (-1 padded) and the accepted draft count per
    request. Greedy drafts are one-hot draft distributions; a seeded request is verified
    with its own generator so its output does not depend on the rest of the batch."""
    b, k = drafts.shape
    device = logits.device
    out = torch.empty(b, k + 1, dtype=torch.int32, device=device)
    emitted = torch.empty(b, dtype=torch.int32, device=device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        # one-hot p and q: the rejection sampler reduces to "keep drafts while they equal
        # the target's argmax, then the argmax" -- the same tokens, without vocab-sized work
        best = logits[greedy].argmax(-1)
        n = (drafts[greedy] == best[:, :k]).int().cumprod(1).sum(1)
        keep = torch.arange(k + 1, device=device)[None, :] <= n[:, None]
        out[greedy] = torch.where(keep, best, -1).to(torch.int32)
        emitted[greedy] = n.to(torch.int32)
    if len(greedy) == b:
        return out, emitted.tolist()
    p = target_probs(logits, params)
    check_distributions(p.flatten(0, 1))
    q = torch.nn.functional.one_hot(drafts, logits.shape[-1]).to(p.dtype)
    shared = [i for i, g in enumerate(generators) if g is None and not params[i].greedy]
    if shared:
        out[shared], _, emitted[shared] = chain_speculative_sampling(q[shared], drafts[shared], p[shared])
    for i, g in enumerate(generators):
        if g is not None and not params[i].greedy:
            o, _, e = chain_speculative_sampling(q[i:i + 1], drafts[i:i + 1], p[i:i + 1], generator=g)
            out[i], emitted[i] = o[0], e[0]
    return out, emitted.tolist()
