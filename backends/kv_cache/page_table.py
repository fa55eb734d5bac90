"""FlashInfer's int32 page-table tensors for a batch, as pure functions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .pages import last_page_len, pages_needed


@dataclass(slots=True)
class PageTable:
    """The interface between the KV cache and attention, for one batch."""
    kv_indptr: torch.Tensor         # [batch + 1] int32
    kv_indices: torch.Tensor        # [total pages] int32
    kv_last_page_len: torch.Tensor  # [batch] int32
    kv_lens: list[int]


def build_page_table(page_lists: list[list[int]], kv_lens: list[int], page_size: int,
                     device: torch.device | str = "cpu") -> PageTable:
    """Page table for sequences with the given pages and KV lengths (after this step).

    Only the pages that hold tokens are listed, so trailing spare pages are ignored.

    >>> t = build_page_table([[7, 3], [5]], [20, 4], page_size=16)
    >>> t.kv_indptr.tolist(), t.kv_indices.tolist(), t.kv_last_page_len.tolist()
    ([0, 2, 3], [7, 3, 5], [4, 4])
    """
    indptr, indices = [0], []
    for pages, kv_len in zip(page_lists, kv_lens):
        used = pages_needed(kv_len, page_size)
        if used > len(pages):
            raise ValueError(f"kv_len {kv_len} needs {used} pages, sequence holds {len(pages)}")
        indices.extend(pages[:used])
        indptr.append(len(indices))
    i32 = dict(dtype=torch.int32, device=device)
    return PageTable(
        kv_indptr=torch.tensor(indptr, **i32),
        kv_indices=torch.tensor(indices, **i32),
        kv_last_page_len=torch.tensor([last_page_len(n, page_size) for n in kv_lens], **i32),
        kv_lens=list(kv_lens),
    )
