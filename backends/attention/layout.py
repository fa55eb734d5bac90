"""Paged KV-cache layouts (NHD / HND) and the index maths over them.

FlashInfer's conventions: a request's KV lives in pages ``kv_indices[kv_indptr[b]:
kv_indptr[b+1]]``; every page is full except the last, which holds
``kv_last_page_len[b]`` (1..page_size) entries.  The cache is one tensor
``[max_num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD) or
``[max_num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND), or a
``(k_cache, v_cache)`` tuple of the same shapes without the ``2``.

Everything here is a pure function over tensors, so it can be tested alone.
"""

from __future__ import annotations

import torch

from ..kv_cache.pages import KV_LAYOUTS as LAYOUTS


def check_layout(kv_layout: str) -> str:
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def split_cache(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(k_cache, v_cache)``, each 4-D, of a single 5-D cache or a tuple."""
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                "paged_kv_cache must be [max_num_pages, 2, ...] (5-D) or a (k_cache, v_cache) "
                f"tuple, got shape {tuple(paged_kv_cache.shape)}"
            )
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k/v caches must be 4-D and equal in shape, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    return k_cache, v_cache


def cache_geometry(k_cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int]:
    """``(page_size, num_kv_heads, head_dim)`` of one 4-D k or v cache."""
    _, a, b, head_dim = k_cache.shape
    return (a, b, head_dim) if kv_layout == "NHD" else (b, a, head_dim)


def page_table(kv_indices: torch.Tensor, starts: list[int], counts: list[int], pages_max: int) -> torch.Tensor:
    """Physical page ids ``[len(starts), pages_max]`` of the requests whose pages are
    ``kv_indices[start:start + count]``; slots past a request's pages hold page 0.

    >>> page_table(torch.tensor([7, 4, 9]), starts=[2, 0], counts=[1, 2], pages_max=2)
    tensor([[9, 0],
            [7, 4]])
    """
    offsets = torch.arange(pages_max)
    count = torch.tensor(counts)
    valid = offsets[None, :] < count[:, None]
    if kv_indices.numel() == 0:
        return torch.zeros(valid.shape, dtype=kv_indices.dtype, device=kv_indices.device)
    flat = (torch.tensor(starts)[:, None] + offsets[None, :]).clamp_(max=kv_indices.numel() - 1)
    flat, valid = flat.to(kv_indices.device), valid.to(kv_indices.device)
    return torch.where(valid, kv_indices[flat], 0)


def cache_rows(cache: torch.Tensor, kv_layout: str, stacked: bool) -> torch.Tensor:
    """A 2-D view of the cache whose rows are contiguous runs of ``page_size`` tokens.

    NHD: one row per (page[, k/v]) holding ``page_size * num_kv_heads * head_dim``.
    HND: one row per (page[, k/v], head) holding ``page_size * head_dim``.
    """
    lead = cache.shape[0] * (2 if stacked else 1)
    if kv_layout == "HND":
        lead *= cache.shape[-3]
    try:
        return cache.view(lead, -1)
    except RuntimeError as err:
        raise ValueError(
            "paged_kv_cache must be contiguous (a per-layer slice of a contiguous pool is "
            f"fine); got strides {cache.stride()}"
        ) from err


def gather_row_index(pages: torch.Tensor, kv_layout: str, num_kv_heads: int, stacked: bool) -> torch.Tensor:
    """Row ids into :func:`cache_rows` that gather ``pages`` (flat physical page ids).

    Shape ``[2, n]`` (NHD) or ``[2, num_kv_heads, n]`` (HND) for a stacked cache,
    where ``[0]`` gathers K and ``[1]`` V; without the leading 2 for one k or v
    cache.  Ordered so the gathered rows view as ``[..., batch, pages * page_size, ...]``.
    """
    pages = pages.long()
    if stacked:
        pages = pages[None, :] * 2 + torch.arange(2, device=pages.device)[:, None]
    if kv_layout == "HND":
        heads = torch.arange(num_kv_heads, device=pages.device)[:, None]
        pages = pages.unsqueeze(-2) * num_kv_heads + heads
    return pages.contiguous()


def gathered_to_bhld(
    rows: torch.Tensor, kv_layout: str, batch: int, num_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """View gathered rows of one of K or V as ``[batch, num_kv_heads, kv_len_padded, head_dim]``."""
    if kv_layout == "NHD":  # rows: [batch * pages, page_size * H * D]
        return rows.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    return rows.view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)  # rows: [H, batch * pages, ...]


def token_slots(
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical ``(page, slot)`` of each appended token at ``positions`` in its request.

    >>> token_slots(torch.tensor([0, 1, 1]), torch.tensor([3, 0, 1]),
    ...             torch.tensor([5, 8, 2]), torch.tensor([0, 2, 3]), page_size=2)
    (tensor([8, 2, 2]), tensor([1, 0, 1]))
    """
    positions = positions.long()
    page = kv_indices.long()[kv_indptr.long()[batch_indices.long()] + positions // page_size]
    return page, positions % page_size


def append_rows(page: torch.Tensor, slot: torch.Tensor, kv_layout: str, num_kv_heads: int,
                page_size: int) -> torch.Tensor:
    """Rows of a stacked cache's ``[-1, head_dim]`` view that the appended tokens' K and V
    go to, in the order of ``stack((k, v), 1)``'s rows: token, then k/v, then head. With
    them a layer's append is one ``index_copy_``.

    >>> append_rows(torch.tensor([3]), torch.tensor([1]), "HND", num_kv_heads=2, page_size=4)
    tensor([49, 53, 57, 61])
    >>> append_rows(torch.tensor([3]), torch.tensor([1]), "NHD", num_kv_heads=2, page_size=4)
    tensor([50, 51, 58, 59])
    """
    page, slot = page.long()[:, None, None], slot.long()[:, None, None]
    kv = torch.arange(2, device=page.device)[None, :, None]
    head = torch.arange(num_kv_heads, device=page.device)[None, None, :]
    if kv_layout == "HND":   # [page, k/v, head, slot]
        rows = ((page * 2 + kv) * num_kv_heads + head) * page_size + slot
    else:                    # [page, k/v, slot, head]
        rows = ((page * 2 + kv) * page_size + slot) * num_kv_heads + head
    return rows.reshape(-1)


def batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request index and KV position of each of ``nnz`` appended tokens (int32).

    ``seq_lens`` are KV lengths *after* the append, so a request's appended tokens
    are its last ``append_len`` positions.

    >>> batch_indices_positions(torch.tensor([0, 1, 3]), torch.tensor([5, 4]), 3)
    (tensor([0, 1, 1], dtype=torch.int32), tensor([4, 2, 3], dtype=torch.int32))
    """
    indptr = append_indptr.long()
    token = torch.arange(nnz, device=indptr.device)
    batch = torch.searchsorted(indptr[1:].contiguous(), token, right=True)
    if nnz and int(batch[-1]) >= indptr.numel() - 1:
        raise ValueError(f"nnz={nnz} exceeds append_indptr[-1]={int(indptr[-1])}")
    append_lens = indptr[1:] - indptr[:-1]
    pos = seq_lens.long()[batch] - append_lens[batch] + (token - indptr[batch])
    return batch.int(), pos.int()
