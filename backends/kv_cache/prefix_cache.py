"""A page allocator with automatic prefix caching (vLLM's block pool, in pages).

Full pages whose KV is complete are *published* under their hash-chain key
(:mod:`.page_hash`); a later prompt with the same prefix *matches* them and shares them
by reference count instead of recomputing. A freed cached page is not erased: it waits
in a least-recently-used queue and is evicted (its key dropped) only when an
allocation finds no never-cached page left. A page is only ever handed out, evicted or
rewritten at reference count 0, so a page that some sequence holds is never touched.
:class:`CachingKVAllocator` writes that contract down for every caching allocator.

>>> a = CachingAllocator(4)
>>> p = a.alloc(2); a.publish(p[0], b"k0"), a.publish(p[1], b"k1")
(True, True)
>>> a.free(p); a.num_free, a.num_cached          # freed, still cached
(4, 2)
>>> a.match([b"k0", b"k1", b"k2"]) == p          # the longest cached chain, now held
True
>>> a.free(p); _ = a.alloc(4); a.num_cached, a.stats.evictions
(0, 2)
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .allocator import KVAllocator, OutOfPages


@dataclass(slots=True)
class CacheStats:
    """Counters since start (pages): prompt pages looked up and found (counted by the
    engine, once a sequence is admitted), evicted."""
    queried_pages: int = 0
    hit_pages: int = 0
    evictions: int = 0
    resets: int = 0


@runtime_checkable
class CachingKVAllocator(KVAllocator, Protocol):
    """A :class:`~.allocator.KVAllocator` that keeps a prefix cache: the contract
    :class:`~tandem.backends.engine.prefix_caching.PrefixCaching` relies on, kept by
    :class:`CachingAllocator` (one process) and by
    :class:`~tandem.backends.disagg.shared_cache.SharedCachingAllocator` (decode's cache
    on the pool shared with kv_transfer). ``isinstance(a, CachingKVAllocator)`` tells a
    caching allocator from a plain one.

    Pages and references: every page a caller holds has a reference count of at least
    one (``ref_count``); ``alloc``/``try_alloc`` hand out pages at count 1 with no key,
    ``match`` adds one reference to each page it returns, ``free`` drops one, and a
    page is handed out, evicted or rewritten only at count 0 (on the shared pool: also
    while no reservation of kv_transfer's shares it). So a page somebody holds is never
    touched.

    Publish: ``publish(page, key)`` caches a held page whose KV is complete under its
    hash-chain key (:mod:`.page_hash`) and returns True; it returns False, leaving the
    page private, when the key is cached already (another sequence computed the same
    page) or the page has a key (on the shared pool: also when this process no longer
    owns the cache). Publishing a page the caller does not hold raises ValueError.
    Keys are unique: at most one page is cached under a key.

    Lookup: ``lookup(keys)`` counts the longest cached prefix of ``keys`` (stopping at
    the first miss) and takes nothing; ``match(keys)`` takes a reference to the pages
    of that prefix, in order (the caller frees them like its own pages).

    Eviction: a cached page whose count drops to 0 stays cached and *evictable*; it
    counts in ``num_free``, and an allocation that finds no page without a key takes
    the least recently freed evictable page, dropping its key (``stats.evictions``).
    ``free`` returns a sequence's pages last first, so its first pages — the ones
    other prompts share — are evicted last.

    Withdraw: ``withdraw(pages)`` unpublishes those of ``pages`` nobody but the caller
    holds (their sequence failed or was cancelled: its KV may be torn) and returns how
    many; pages another holder shares stay cached. The caller still holds all of them
    and frees them afterwards; a withdrawn page then goes back as a plain free page.
    Only :class:`~tandem.backends.engine.prefix_caching.PrefixCaching` withdraws.

    Reset: ``reset()`` drops every key (a new model version); held pages stay with
    their holders, evictable ones become free. Returns how many pages were cached.

    ``num_cached`` counts the pages with a key; ``stats`` the lookups (counted by the
    engine), evictions and resets since start.
    """

    @property
    def num_cached(self) -> int: ...

    @property
    def stats(self) -> CacheStats: ...

    def ref_count(self, page: int) -> int: ...

    def lookup(self, keys: list[bytes]) -> int: ...

    def match(self, keys: list[bytes]) -> list[int]: ...

    def publish(self, page: int, key: bytes) -> bool: ...

    def withdraw(self, pages: list[int]) -> int: ...

    def reset(self) -> int: ...


class CachingAllocator:
    """:class:`CachingKVAllocator` in one process: freed full pages stay cached until
    needed."""


    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._key: list[bytes | None] = [None] * num_pages
        self._cached: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_pages))        # never cached, or dropped
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self.stats = CacheStats()

    # -- KVAllocator ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_alloc(self, n: int) -> bool:
        return n <= self.num_free

    def try_alloc(self, n: int) -> list[int] | None:
        return self.alloc(n) if n <= self.num_free else None

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:   # the least recently used cached page gives up its key
                p, _ = self._evictable.popitem(last=False)
                del self._cached[self._key[p]]
                self._key[p] = None
                self.stats.evictions += 1
            self._ref[p] = 1
            pages.append(p)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. A sequence's pages go back last first, so its
        first pages (the ones other prompts share) are evicted last."""
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page id {p} out of range 0..{self.num_pages - 1}")
            if self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated (double free?)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} list a page twice (double free?)")
        for p in reversed(pages):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if self._key[p] is not None:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # -- the cache --------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def lookup(self, keys: list[bytes]) -> int:
        """How many of ``keys``' first pages are cached (nothing is taken)."""
        n = 0
        for k in keys:
            if k not in self._cached:
                break
            n += 1
        return n

    def match(self, keys: list[bytes]) -> list[int]:
        """Take a reference to the pages of the longest cached prefix of ``keys``."""
        pages = []
        for k in keys:
            p = self._cached.get(k)
            if p is None:
                break
            if self._ref[p] == 0:
                del self._evictable[p]
            self._ref[p] += 1
            pages.append(p)
        return pages

    def publish(self, page: int, key: bytes) -> bool:
        """Cache held ``page`` (its KV complete) under ``key``. False when the key is
        cached already (another sequence computed the same page: this one stays
        private) or the page has a key."""
        if self._ref[page] <= 0:
            raise ValueError(f"page {page} is not allocated; only a held page is published")
        if key in self._cached or self._key[page] is not None:
            return False
        self._cached[key] = page
        self._key[page] = key
        return True

    def withdraw(self, pages: list[int]) -> int:
        """Unpublish those of ``pages`` nobody else holds (their owner failed or was
        cancelled); pages another sequence shares stay cached. Returns how many."""
        n = 0
        for p in pages:
            if self._ref[p] == 1 and self._key[p] is not None:
                del self._cached[self._key[p]]
                self._key[p] = None
                n += 1
        return n

    def reset(self) -> int:
        """Empty the cache (a new model version): every key is dropped, held pages stay
        with their holders. Returns how many pages were cached."""
        n = len(self._cached)
        for p in self._evictable:
            self._free.append(p)
        self._evictable.clear()
        for p in self._cached.values():
            self._key[p] = None
        self._cached.clear()
        self.stats.resets += 1
        return n
