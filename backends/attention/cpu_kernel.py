"""The C++ paged-attention kernel for few query rows per request
(backends/cpu_kernels/paged_attention.cpp).

It reads K and V in place from their pages; the pure-torch path gathers every page of
the batch into a padded copy per layer and masks it, which at 16 decode rows of a
30-layer model with ~400-token contexts was half the step (``tandem bench profile``).
Where the kernel is unavailable (:func:`load`), attention stays on the torch path.
"""
from __future__ import annotations

import torch

from .. import cpu_kernels

# requests with more query rows than this go to the torch path: there a padded SDPA
# over a long chunk (prefill) runs as matrix products, which beat this kernel's loops
MAX_QO_LEN = 16


def load() -> bool:
    return cpu_kernels.load("attention")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, hnd: bool,
                    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_lens: torch.Tensor, num_kv_heads: int, causal: bool, sm_scale: float) -> torch.Tensor:
    """Attention of ragged ``q [nnz, Hq, D]`` over the pages of each request (FlashInfer's
    indptr conventions; ``kv_lens`` per request); int64 indices."""
    return torch.ops.tandem_cpu.paged_attention(q, k_cache, v_cache, hnd, qo_indptr, kv_indptr,
                                                 kv_indices, kv_lens, num_kv_heads, causal, sm_scale)
