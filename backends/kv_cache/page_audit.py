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

A checksum cannot tell a page that was wrong when it was published (a bug that wrote
the wrong KV, keyed a page under the wrong prefix, or published it before it was
complete). So a second, costlier audit (``--kv-audit-recompute RATE``) declines a
sampled share of hits outright: the request computes its prefix afresh, and when it
publishes those pages, each is compared with the cached page under the same key
(:func:`pages_agree`: the recomputed KV may differ from the cached in the last bits, as
a batch's shape changes the order of the sums, never by more than a sliver of the
page's range). A cached page that disagrees leaves the cache, the fresh page takes its
place, and the mismatch is counted.

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


# how far a recomputed page may differ from the cached one, as a share of the cached
# page's largest magnitude (per pool): rounding noise (bf16 keeps 8 bits: ~0.4%) passes,
# another prompt's KV (differences of the order of the values themselves) does not
RECOMPUTE_TOLERANCE = 0.05


def pages_agree(pools: list[KVPagePool], cached: int, fresh: int) -> bool:
    """Whether ``fresh`` (just recomputed) holds the KV ``cached`` does, up to rounding.

    >>> from tandem.backends.kv_cache.page_pool import KVPagePool
    >>> pool = KVPagePool(2, 4, 1, 4, 8, torch.float32)
    >>> pool.kv[:, 1] = torch.randn_like(pool.kv[:, 1]); pool.kv[:, 2] = pool.kv[:, 1] * (1 + 1e-3)
    >>> pages_agree([pool], 1, 2), pages_agree([pool], 1, 3)
    (True, False)
    """
    for pool in pools:
        want, got = pool.kv[:, cached].float(), pool.kv[:, fresh].float()
        if float((got - want).abs().max()) > RECOMPUTE_TOLERANCE * float(want.abs().max()) + 1e-6:
            return False
    return True


def page_checksum(pools: list[KVPagePool], page: int) -> int:
    """CRC-32 of ``page``'s KV in every layer of ``pools``."""
    crc = 0
    for pool in pools:
        crc = zlib.crc32(pool.kv[:, page].contiguous().view(torch.uint8).numpy(), crc)
    return crc


class PageAudit:
    """The checksums of one engine's published pages, and the sampled checks of its hits
    (engine thread only). ``rate``: the share of hits checked, 0 to 1; ``recompute_rate``:
    the share of hits declined and recomputed, their pages compared when republished."""

    def __init__(self, pools: list[KVPagePool], rate: float, seed: int | None = None,
                 recompute_rate: float = 0.0):
        for name, value in (("kv_audit", rate), ("kv_audit_recompute", recompute_rate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} {value!r}; allowed: 0 to 1 (the share of prefix-cache hits checked)")
        self.pools, self.rate, self.recompute_rate = list(pools), rate, recompute_rate
        self._sums: dict[int, int] = {}
        self._condemned: set[int] = set()   # found changed, still cached (another holder kept it)
        self._rng = random.Random(seed)
        self.checked_pages = 0     # pages whose checksum was recomputed on a hit, since start
        self.mismatches = 0        # ... and found changed since publication
        self.compared_pages = 0    # recomputed pages compared with the cached page of their key
        self.disagreements = 0     # ... that held other KV (the cached page is dropped)

    def record(self, page: int) -> None:
        """``page`` was just published: its content is the reference from now on (a
        record of its earlier publications goes; a page found changed is served again
        only once republished, i.e. recomputed)."""
        if self.rate > 0:
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
        return self._draw(self.rate)

    def decline(self) -> bool:
        """Whether this hit is declined and computed afresh (the recompute audit's share)."""
        return self._draw(self.recompute_rate)

    def _draw(self, rate: float) -> bool:
        return rate > 0 and (rate >= 1.0 or self._rng.random() < rate)

    def agrees(self, cached: int, fresh: int) -> bool:
        """Compare recomputed page ``fresh`` with ``cached``, published under the same key
        (counted); a cached page that disagrees is condemned (never served again)."""
        self.compared_pages += 1
        if pages_agree(self.pools, cached, fresh):
            return True
        self.disagreements += 1
        self._sums.pop(cached, None)
        self._condemned.add(cached)
        return False

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
