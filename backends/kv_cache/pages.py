"""Page arithmetic and the KV layouts' names: pure, torch-free (settings import them)."""
from __future__ import annotations

KV_LAYOUTS = ("HND", "NHD")   # FlashInfer's names; HND keeps a page of one layer contiguous


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ceil(num_tokens / page_size).

    >>> pages_needed(33, 16)
    3
    """
    return -(-num_tokens // page_size)


def last_page_len(kv_len: int, page_size: int) -> int:
    """Tokens in the last page, 1..page_size (FlashInfer's ``kv_last_page_len``)."""
    return (kv_len - 1) % page_size + 1 if kv_len > 0 else 0
