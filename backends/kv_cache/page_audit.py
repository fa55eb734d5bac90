"""Cached pages that can be checked: a page's content checksum is recorded when it is
published to the prefix cache, and a sampled share of cache hits (``--kv-audit RATE``)
has its pages' checksums recomputed and compared before the request uses them. A page
whose content changed since it was published (a stray write into a shared page, memory
corruption) is never served: the hit stops short of it, it leaves the cache, the
request computes it afresh, and the mismatch is counted.

The checksum is CRC-32 over the page's bytes in every layer of every KV pool the cache
covers (the target's, and a proposer's cached alongside): ~0.14 ms per page of
SmolLM2-135M (368 KiB, bf16) on one core, where the page's prefill costs milliseconds.
CRC-32 detects every error burst up to 32 bits, so any one flipped byte.

>>> import torch
>>> from tandem.backends.kv_cache.page_pool import KVPagePool
>>> pool = KVPagePool(2, 4, 1, 4, 8, torch.float32)
>>> audit = PageAudit([pool], rate=1.0)
>>> audit.record(1); audit.check([1])
>>> pool.kv[1, 1].view(-1)[3] += 1.0       # a write after publication
>>> audit.check([1]), audit.mismatches
(0, 1)
"""
from __future__ import annotations

import random
import zlib

import torch

from .page_pool import KVPagePool


def page_checksum(pools: list[KVPagePool], page: int) -> int:
    """CRC-32 of ``page``'s KV in every layer of ``pools``."""
    crc = 0
    for pool in pools:
        crc = zlib.crc32(pool.kv[:, page].contiguous().view(torch.uint8).numpy(), crc)
    return crc


class PageAudit:
    """The checksums of one engine's published pages, and the sampled checks of its hits
    (engine thread only). ``rate``: the share of hits checked, 0 to 1."""

    def __init__(self, pools: list[KVPagePool], rate: float, seed: int | None = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"kv_audit {rate!r}; allowed: 0 to 1 (the share of prefix-cache hits checked)")
        self.pools, self.rate = list(pools), rate
        self._sums: dict[int, int] = {}
        self._condemned: set[int] = set()   # found changed, still cached (another holder kept it)
        self._rng = random.Random(seed)
        self.checked_pages = 0     # pages whose checksum was recomputed on a hit, since start
        self.mismatches = 0        # ... and found changed since publication

    def record(self, page: int) -> None:
        """``page`` was just published: its content is the reference from now on (a
        record of its earlier publications goes; a page found changed is served again
        only once republished, i.e. recomputed)."""
        self._sums[page] = page_checksum(self.pools, page)
        self._condemned.discard(page)

    def cut(self, pages: list[int]) -> int | None:
        """Where a hit on ``pages`` must stop: at the first page found changed before
        (always, cheap) or, for a sampled hit, found changed now; None: nowhere."""
        for i, page in enumerate(pages):
            if page in self._condemned:
                return i
        return self.check(pages) if self.sampled() else None

    def sampled(self) -> bool:
        """Whether this hit is checked (the rate's share of hits, at random)."""
        return self.rate > 0 and (self.rate >= 1.0 or self._rng.random() < self.rate)

    def check(self, pages: list[int]) -> int | None:
        """The index of the first of ``pages`` whose content differs from what was
        published (counted; its record forgotten), or None when every recorded one
        matches (a page with no record, published before recording began, passes)."""
        for i, page in enumerate(pages):
            want = self._sums.get(page)
            if want is None:
                continue
            self.checked_pages += 1
            if page_checksum(self.pools, page) != want:
                self.mismatches += 1
                del self._sums[page]
                self._condemned.add(page)
                return i
        return None
