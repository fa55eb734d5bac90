"""From logits to tokens, per request settings: plain sampling (temperature, top-k,
top-p, seeds) and the verification of greedy drafts. Pure tensor maths; a seeded request's
randomness is its own (seeded_draws.py), so its tokens do not depend on the batch or on
speculation."""
from __future__ import annotations

import torch

from ..speculative.verify import chain_speculative_sampling
from .params import SamplingParams
from .seeded_draws import inverse_cdf, seeded_uniforms


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


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token per row. Greedy rows take the argmax; the others draw from their
    filtered distribution: a seeded request with the uniform of its output position
    ``positions[i]`` (the same token whatever else is in the batch, and whether or not
    speculation ran before), an unseeded one from torch's global generator."""
    tokens = logits.argmax(-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    probs = request_probs(logits[rows, None], [params[i] for i in rows])[:, 0]
    check_distributions(probs)
    for j, i in enumerate(rows):
        seed = params[i].seed
        if seed is None:
            tokens[i] = int(torch.multinomial(probs[j], 1))
        else:
            tokens[i] = int(inverse_cdf(probs[j], torch.tensor(seeded_uniforms(seed, [positions[i]]))[0]))
    return tokens


def sampling_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] log-probabilities of the distribution row ``i`` samples from: the
    log-softmax of the logits after temperature, top-k and top-p, or for a greedy request
    of the logits themselves (temperature 1, as vLLM reports for temperature 0).
    ``logits`` [N, V] are the processed logits (controls applied).

    >>> lp = sampling_logprobs(torch.log(torch.tensor([[0.5, 0.25, 0.25]])),
    ...                        [SamplingParams(temperature=0)])
    >>> round(float(lp[0, 1]), 4)
    -1.3863
    """
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        logits = logits.clone()
        logits[rows] = filtered_logits(logits[rows], *_per_row([params[i] for i in rows], 1,
                                                               logits))
    return logits.float().log_softmax(-1)


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
                  positions: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Verify greedy drafts [B, k] against target logits [B, k+1, V].

    Returns the verified tokens [B, k+1] (-1 padded) and the accepted draft count per
    request. Greedy drafts are one-hot draft distributions. A greedy request keeps drafts
    while they equal the target's argmax; a seeded one while they equal its own draws at
    output positions ``positions[i]``.. (seeded_draws.py: exactly lossless, and the tokens
    plain sampling would give); an unseeded one goes through the rejection sampler."""
    b, k = drafts.shape
    device = logits.device
    out = torch.empty(b, k + 1, dtype=torch.int32, device=device)
    emitted = torch.empty(b, dtype=torch.int32, device=device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        # one-hot p and q: the rejection sampler reduces to "keep drafts while they equal
        # the target's argmax, then the argmax" -- the same tokens, without vocab-sized work
        _keep_matching(logits[greedy].argmax(-1), drafts[greedy], out, emitted, greedy)
    if len(greedy) == b:
        return out, emitted.tolist()
    p = target_probs(logits, params)
    check_distributions(p.flatten(0, 1))
    seeded = [i for i, sp in enumerate(params) if not sp.greedy and sp.seed is not None]
    if seeded:
        u = torch.tensor([seeded_uniforms(params[i].seed, range(positions[i], positions[i] + k + 1))
                          for i in seeded])
        _keep_matching(inverse_cdf(p[seeded], u).to(device), drafts[seeded], out, emitted, seeded)
    shared = [i for i, sp in enumerate(params) if not sp.greedy and sp.seed is None]
    if shared:
        q = torch.nn.functional.one_hot(drafts[shared], logits.shape[-1]).to(p.dtype)
        out[shared], _, emitted[shared] = chain_speculative_sampling(q, drafts[shared], p[shared])
    return out, emitted.tolist()


def _keep_matching(tokens: torch.Tensor, drafts: torch.Tensor, out: torch.Tensor, emitted: torch.Tensor,
                   rows: list[int]) -> None:
    """Rows ``rows`` of ``out``/``emitted`` from the target's own tokens [R, k+1] at each
    position: the drafts kept while they equal them, then the target's token."""
    k = drafts.shape[1]
    n = (drafts == tokens[:, :k]).int().cumprod(1).sum(1)
    keep = torch.arange(k + 1, device=tokens.device)[None, :] <= n[:, None]
    out[rows] = torch.where(keep, tokens, -1).to(torch.int32)
    emitted[rows] = n.to(torch.int32)
