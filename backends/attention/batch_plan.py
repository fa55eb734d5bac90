"""Per-batch attention metadata for the CPU (torch) path, computed once in ``plan()``.

A batch is split into *groups* of requests; each group is one padded
``scaled_dot_product_attention`` call over ``[n, heads, rows, kv_max]``.  A decode
batch is one group; a mixed batch (a long prefill beside many decodes) is split
where padding everyone to the longest request would cost more than another call.

Two query arrangements:

* folded (decode, speculative verification: few query rows): the GQA group of
  ``g = num_qo_heads // num_kv_heads`` query heads becomes extra query rows, so
  q is ``[n, num_kv_heads, qo_max * g, D]`` against K/V ``[n, num_kv_heads, L, D]``
  and SDPA never repeats K/V (about 2x faster on CPU than ``enable_gqa``);
* per head (long prefill): q is ``[n, num_qo_heads, qo_max, D]`` with
  ``enable_gqa=True``, so the mask stays ``[n, 1, qo_max, kv_max]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv_cache.pages import pages_needed
from . import layout

# Extra cost of one more SDPA call, in units of (query row x kv position).
_CALL_OVERHEAD = 8192
# Fold GQA heads into query rows while a request has at most this many rows.
_FOLD_MAX_ROWS = 64


@dataclass(slots=True)
class AttentionGroup:
    """Requests attended by one SDPA call, padded to ``qo_max`` x ``kv_max``."""

    num_reqs: int
    qo_max: int
    kv_max: int
    fold_heads: bool
    pages: torch.Tensor  # [num_reqs * pages_max] physical page ids (padding: page 0)
    q_rows: torch.Tensor | None  # [num_reqs * qo_max] rows of ragged q; None: q is already padded
    out_src: torch.Tensor | None  # real rows of the padded output; None: every row is real
    out_dst: torch.Tensor | None  # their rows in the ragged output; None: same order
    mask: torch.Tensor | None  # bool [num_reqs, 1, rows | 1, kv_max], True = attend
    is_causal: bool  # mask is plain top-left causal (qo_len == kv_len for all)
    gather: dict = field(default_factory=dict)  # run()'s gather index and buffer views, built on first run
    float_mask: dict = field(default_factory=dict)  # dtype -> additive mask, built on first run


@dataclass(slots=True)
class BatchPlan:
    groups: list[AttentionGroup]
    nnz_qo: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    identity: bool  # one group, original order, no padding: output is the SDPA output
    # the C++ kernel attends (no groups built): qo_max <= the caller's kernel_max_qo
    kernel: bool = False
    kv_lens: list[int] = field(default_factory=list)


def group_requests(qo_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Split requests into padded groups, cheapest first-fit over (qo_len, kv_len) order.

    >>> group_requests([1, 1, 1], [200, 250, 256])
    [[0, 1, 2]]
    >>> group_requests([1, 512, 1], [256, 512, 300])
    [[0, 2], [1]]
    """
    order = sorted((b for b in range(len(qo_lens)) if qo_lens[b] > 0), key=lambda b: (qo_lens[b], kv_lens[b]))
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_qo = cur_kv = 0
    for b in order:
        qo, kv = qo_lens[b], kv_lens[b]
        if cur:
            new_qo, new_kv = max(cur_qo, qo), max(cur_kv, kv)
            merged = (len(cur) + 1) * new_qo * new_kv
            separate = len(cur) * cur_qo * cur_kv + _CALL_OVERHEAD + qo * kv
            if merged <= separate:
                cur.append(b)
                cur_qo, cur_kv = new_qo, new_kv
                continue
            groups.append(sorted(cur))
        cur, cur_qo, cur_kv = [b], qo, kv
    if cur:
        groups.append(sorted(cur))
    return groups


def attention_mask(
    qo_lens: torch.Tensor, kv_lens: torch.Tensor, qo_max: int, kv_max: int, causal: bool
) -> torch.Tensor:
    """Bool ``[n, qo_max, kv_max]``: query i of a request sees kv j < kv_len, and with
    ``causal`` also j <= i + kv_len - qo_len (queries are the last qo_len tokens).
    Padding query rows see position 0 only, so no row is fully masked (NaN-free).

    >>> attention_mask(torch.tensor([2]), torch.tensor([3]), 2, 3, causal=True).int()
    tensor([[[1, 1, 0],
             [1, 1, 1]]], dtype=torch.int32)
    """
    i = torch.arange(qo_max)[None, :, None]
    j = torch.arange(kv_max)[None, None, :]
    qo, kv = qo_lens[:, None, None], kv_lens[:, None, None]
    mask = j < kv
    if causal:
        mask = mask & (j <= i + (kv - qo))
    return mask | ((i >= qo) & (j == 0))


def _build_group(
    members: list[int],
    qo_ptr: list[int],
    kv_ptr: list[int],
    qo_lens: list[int],
    kv_lens: list[int],
    kv_indices: torch.Tensor,
    *,
    page_size: int,
    group_size: int,
    causal: bool,
    identity: bool,
) -> AttentionGroup:
    n = len(members)
    qo_list, kv_list = [qo_lens[b] for b in members], [kv_lens[b] for b in members]
    qo_max, kv_max = max(qo_list), max(kv_list)
    pages_max = pages_needed(kv_max, page_size)
    starts = [kv_ptr[b] for b in members]
    counts = [kv_ptr[b + 1] - kv_ptr[b] for b in members]
    if all(c == pages_max for c in counts) and starts == list(range(starts[0], starts[0] + n * pages_max, pages_max)):
        pages = kv_indices[starts[0] : starts[0] + n * pages_max]  # already a dense page table
    else:
        pages = layout.page_table(kv_indices, starts, counts, pages_max).reshape(-1)

    padded = any(q != qo_max for q in qo_list)
    to = kv_indices.device
    q_rows = out_src = out_dst = None
    qo = None
    if not identity:
        qo = torch.tensor(qo_list)
        offs = torch.arange(qo_max)
        real = offs[None, :] < qo[:, None]  # [n, qo_max]
        rows = torch.tensor([qo_ptr[b] for b in members])[:, None] + offs[None, :]
        q_rows = torch.where(real, rows, 0).reshape(-1).to(to)
        out_dst = rows[real].to(to)
        out_src = real.reshape(-1).nonzero().squeeze(1).to(to) if padded else None

    fold = qo_max * group_size <= _FOLD_MAX_ROWS
    uniform = not padded and all(k == kv_max for k in kv_list)
    is_causal = causal and uniform and qo_max == kv_max and not fold
    mask = None
    if not is_causal and not (uniform and (not causal or qo_max == 1)):
        if qo_max == 1:  # decode: only kv padding to hide (causal changes nothing)
            mask = torch.arange(kv_max)[None, None, :] < torch.tensor(kv_list)[:, None, None]
        else:
            qo = torch.tensor(qo_list) if qo is None else qo
            mask = attention_mask(qo, torch.tensor(kv_list), qo_max, kv_max, causal)
            if fold:  # folded row r is query r // group_size
                mask = mask.repeat_interleave(group_size, dim=1)
        mask = mask.unsqueeze(1).to(to)
    return AttentionGroup(
        num_reqs=n,
        qo_max=qo_max,
        kv_max=kv_max,
        fold_heads=fold,
        pages=pages,
        q_rows=q_rows,
        out_src=out_src,
        out_dst=out_dst,
        mask=mask,
        is_causal=is_causal,
    )


def plan_batch(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    causal: bool,
    sm_scale: float | None,
    kernel_max_qo: int = 0,
) -> BatchPlan:
    """Validate FlashInfer-style indices and build the groups for ``run()``, or none
    when every request has at most ``kernel_max_qo`` queries (the C++ kernel's case)."""
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    # The metadata is tiny: plain lists are much cheaper than many small tensor ops.
    qo_ptr, kv_ptr, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_last_page_len.tolist()
    batch = len(last)
    if len(qo_ptr) != batch + 1 or len(kv_ptr) != batch + 1:
        raise ValueError(
            f"qo_indptr and kv_indptr need batch_size + 1 = {batch + 1} entries, got {len(qo_ptr)} and {len(kv_ptr)}"
        )
    num_pages = [b - a for a, b in zip(kv_ptr, kv_ptr[1:])]
    if any(n > 0 and not 1 <= lp <= page_size for n, lp in zip(num_pages, last)):
        raise ValueError(f"kv_last_page_len must be in 1..page_size={page_size}, got {last}")
    qo_lens = [b - a for a, b in zip(qo_ptr, qo_ptr[1:])]
    kv_lens = [(n - 1) * page_size + lp if n > 0 else 0 for n, lp in zip(num_pages, last)]
    if causal and any(q > k for q, k in zip(qo_lens, kv_lens)):
        raise ValueError(f"causal attention needs qo_len <= kv_len per request, got qo_lens={qo_lens} kv_lens={kv_lens}")
    if any(q > 0 and k == 0 for q, k in zip(qo_lens, kv_lens)):
        raise ValueError("a request with queries has no KV pages")

    kernel = kernel_max_qo > 0 and max(qo_lens, default=0) <= kernel_max_qo
    members = [] if kernel else group_requests(qo_lens, kv_lens)
    identity = len(members) == 1 and len(members[0]) == batch and len(set(qo_lens)) == 1
    group_size = num_qo_heads // num_kv_heads
    groups = [
        _build_group(m, qo_ptr, kv_ptr, qo_lens, kv_lens, kv_indices, page_size=page_size,
                     group_size=group_size, causal=causal, identity=identity)
        for m in members
    ]
    return BatchPlan(
        groups=groups,
        nnz_qo=qo_ptr[-1] if qo_ptr else 0,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale),
        identity=identity,
        kernel=kernel,
        kv_lens=kv_lens,
    )
