"""What tests read out of KV pools and how they name a proposer: shared by the
prefill, disaggregation and prefix-cache tests."""
from __future__ import annotations

from tandem.backends.speculative import SpeculativeConfig


def token_kv(pool, pages, n):
    """[layers, 2, n, heads, head_dim]: the KV of a sequence's first n tokens, from a pool
    of either layout (HND pages [2, H, page_size, D], NHD [2, page_size, H, D])."""
    kv = pool.kv[:, list(pages)]
    kv = kv.permute(0, 2, 1, 4, 3, 5) if pool.kv_layout == "HND" else kv.permute(0, 2, 1, 3, 4, 5)
    return kv.reshape(kv.shape[0], 2, -1, *kv.shape[4:])[:, :, :n]


def spec_for(method, draft_dir, mtp_dir, k: int = 3) -> SpeculativeConfig | None:
    """draft_target with ``draft_dir`` as the draft, mtp with the head in ``mtp_dir``,
    None for plain decoding."""
    if method == "draft_target":
        return SpeculativeConfig("draft_target", k, draft_model=str(draft_dir))
    if method == "mtp":
        return SpeculativeConfig("mtp", k, mtp_head=str(mtp_dir))
    return None
