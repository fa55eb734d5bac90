"""Decode's prefix cache on the shared pool: the engine's caching allocator over
:class:`tandem.rdma.SharedKVPool`.

The engine sees a :class:`~tandem.backends.kv_cache.prefix_cache.CachingKVAllocator`
(allocate, free, match, publish, withdraw, reset); the pool keeps which pages are
cached, pinned by kv_transfer's reservations or evictable, so kv_transfer can look a
prompt up and reserve only what decode lacks. This process counts its own references
(several of its sequences may share a page); the pool knows only that decode holds the
page. Pages a claimed reservation hands over are adopted here (:meth:`adopt`).

>>> from tandem.rdma import PoolSpec, SharedKVPool
>>> from tandem.rdma.plan import ModelSpec
>>> pool = SharedKVPool.create(PoolSpec("doc-cache", (ModelSpec("t", 1, 1, 4, 2, "uint8"),), 4, max_pins=4))
>>> a = SharedCachingAllocator(pool, root=bytes(16))
>>> p = a.alloc(2); a.publish(p[0], b"k" * 16)
True
>>> a.free(p); a.num_free, a.num_cached
(4, 1)
>>> a.match([b"k" * 16]) == p[:1]
True
>>> pool.close(unlink_if_last=True)
True
"""
from __future__ import annotations

from collections import Counter

from tandem.rdma import SharedKVPool, SharedPageAllocator

from ..kv_cache.prefix_cache import CacheStats


class SharedCachingAllocator(SharedPageAllocator):
    """Prefix caching on a shared pool this process (decode) owns the cache of; its
    free count includes evictable cached pages: a
    :class:`~tandem.backends.kv_cache.prefix_cache.CachingKVAllocator`."""


    def __init__(self, pool: SharedKVPool, root: bytes):
        if not pool.caching:
            raise ValueError(f"shared pool {pool.spec.name!r} has no prefix cache (max_pins=0)")
        super().__init__(pool)
        self._ref: Counter[int] = Counter()
        self._stats = CacheStats()
        pool.become_cache_owner(root)   # what an earlier owner (version) cached is dropped

    # -- KVAllocator ------------------------------------------------------------------
    def try_alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        pages = self.pool.try_alloc(n)
        if pages is not None:
            self._ref.update(pages)
        return pages

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        pages = self.pool.alloc(n)
        self._ref.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages no sequence holds any more go back to
        the pool (cached ones stay cached, evictable), last pages first."""
        for p in pages:
            if self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated (double free?)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} list a page twice (double free?)")
        last = []
        for p in reversed(pages):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                del self._ref[p]
                last.append(p)
        if last:
            self.pool.cache_free(last)

    def adopt(self, pages: list[int]) -> None:
        """Pages a claimed reservation handed over (its shared pages first): this
        process holds one more reference to each."""
        self._ref.update(pages)

    # -- the cache --------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        # read on every admission (the lookup counts): the eviction count without the lock
        self._stats.evictions = self.pool.cache_evictions
        return self._stats

    @property
    def num_cached(self) -> int:
        return self.pool.cache_counts()[0]

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def lookup(self, keys: list[bytes]) -> int:
        return self.pool.cache_lookup(keys)

    def match(self, keys: list[bytes]) -> list[int]:
        pages = self.pool.cache_match(keys)
        self._ref.update(pages)
        return pages

    def publish(self, page: int, key: bytes) -> bool:
        if self._ref[page] <= 0:
            raise ValueError(f"page {page} is not allocated; only a held page is published")
        return self.pool.cache_publish(page, key)

    def withdraw(self, pages: list[int]) -> int:
        """Unpublish those of ``pages`` only this sequence holds (no other sequence here,
        no reservation of kv_transfer's)."""
        mine = [p for p in pages if self._ref[p] == 1]
        return self.pool.cache_drop(mine) if mine else 0

    def reset(self) -> int:
        self._stats.resets += 1
        return self.pool.cache_reset()
