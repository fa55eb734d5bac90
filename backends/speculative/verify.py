"""Lossless verification of a linear draft: FlashInfer's ``chain_speculative_sampling``.

Pure torch on CPU, FlashInfer's fused kernel on CUDA, same signature and semantics:
accept draft token d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection draw from normalize(max(0, p_i - q_i)); if all n are accepted draw the bonus
token from p_n. The output follows p exactly, whatever q is (Leviathan et al., 2023;
Chen et al., 2023). Greedy drafts are verified as one-hot q.
"""
from __future__ import annotations

import torch


def _flashinfer_sampling():
    try:
        import flashinfer.sampling as fs  # the CUDA path only; never imported on CPU
    except ImportError:
        return None
    return fs


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                               target_probs: torch.Tensor,
                               maybe_output_accepted_token_num: torch.Tensor | None = None,
                               maybe_output_emitted_draft_token_num: torch.Tensor | None = None,
                               deterministic: bool = True,
                               generator: torch.Generator | None = None,
                               seed: int | None = None, offset: int | None = None):
    """Verify ``n`` draft tokens per request against ``n + 1`` target distributions.

    draft_probs [B, n, V], draft_token_ids [B, n], target_probs [B, n + 1, V].
    Returns ``(output_token_ids [B, n + 1] int32 padded with -1, accepted_num [B],
    emitted_num [B])``: ``emitted_num`` draft tokens were kept and one more token
    follows them; ``accepted_num`` counts positions that would pass on their own (the
    acceptance-rate statistic). Both counters are *added* into the optional output
    tensors, as FlashInfer does.

    >>> q = torch.tensor([[[0., 1.], [0., 1.]]]); p = torch.tensor([[[0., 1.], [1., 0.], [.5, .5]]])
    >>> out, acc, emit = chain_speculative_sampling(q, torch.tensor([[1, 1]]), p)
    >>> out.tolist(), acc.tolist(), emit.tolist()
    ([[1, 0, -1]], [1], [1])
    """
    if target_probs.is_cuda and (fs := _flashinfer_sampling()) is not None:
        return fs.chain_speculative_sampling(
            draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num,
            maybe_output_emitted_draft_token_num, deterministic, generator, seed, offset)
    batch, n = draft_token_ids.shape
    if draft_probs.shape[:2] != (batch, n) or target_probs.shape[:2] != (batch, n + 1):
        raise ValueError(f"shape mismatch: draft_probs {tuple(draft_probs.shape)}, draft_token_ids "
                         f"{tuple(draft_token_ids.shape)}, target_probs {tuple(target_probs.shape)}")
    if generator is None and seed is not None:
        generator = torch.Generator(target_probs.device).manual_seed(int(seed) + int(offset or 0))
    device = target_probs.device
    ids = draft_token_ids.long()
    u = torch.rand(batch, n, generator=generator, device=device)
    p = target_probs[:, :n].gather(-1, ids[..., None]).squeeze(-1).float()
    q = draft_probs.gather(-1, ids[..., None]).squeeze(-1).float()
    accept = u * q < p                        # u < p / q without dividing by q = 0
    accepted = accept.sum(1).to(torch.int32)
    emitted = accept.int().cumprod(1).sum(1)  # the accepted prefix
    rows = torch.arange(batch, device=device)
    # the token after the prefix: from max(0, p - q) at a rejection, from p_n otherwise
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, target_probs.shape[-1])], 1)
    residual = (target_probs[rows, emitted].float() - q_pad[rows, emitted].float()).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual, target_probs[rows, emitted].float())
    nxt = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    out = torch.full((batch, n + 1), -1, dtype=torch.int32, device=device)
    keep = torch.arange(n, device=device)[None, :] < emitted[:, None]
    out[:, :n] = torch.where(keep, ids, -1).to(torch.int32)
    out[rows, emitted] = nxt.to(torch.int32)
    emitted = emitted.to(torch.int32)
    if maybe_output_accepted_token_num is not None:
        maybe_output_accepted_token_num += accepted
    if maybe_output_emitted_draft_token_num is not None:
        maybe_output_emitted_draft_token_num += emitted
    return out, accepted, emitted
