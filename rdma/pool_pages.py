"""Who holds each page of the shared pool, and the free stack.

The canonical state is per page: its owner (0: free, else an owner id of
:mod:`.pool_owners`), the reservation slot it belongs to (-1: none) and its place in
that reservation's sequence. The free stack is derived from the owners, so the pool
rebuilds it whenever a process died half-way through a change. Cached pages nobody
uses (:mod:`.pool_cache`) count as free: an allocation that empties the stack evicts
the least recently used of them.
"""
from __future__ import annotations

import numpy as np

from .errors import PoolExhausted
from .pool_cache import PrefixIndex
from .pool_layout import H_FREE_TOP, ControlBlock


class SharedPages:
    """The page arrays of a :class:`~.pool_layout.ControlBlock`. Every method expects
    the pool's lock to be held, except :attr:`num_free` (racy reads)."""

    def __init__(self, ctl: ControlBlock, num_pages: int, cache: PrefixIndex):
        self._ctl, self.num_pages, self.cache = ctl, num_pages, cache

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: the free stack and evictable cached pages."""
        return int(self._ctl.hdr[H_FREE_TOP]) + self.cache.num_evictable

    def num_reserved(self) -> int:
        """Pages held by reservations (not yet claimed)."""
        return int((self._ctl.page_slot >= 0).sum())

    def reset(self) -> None:
        """Every page free (a new pool)."""
        self._ctl.page_owner[:] = 0
        self._ctl.page_slot[:] = -1
        self.rebuild()

    def rebuild(self, live_slots: np.ndarray | None = None) -> None:
        """Derive the free stack from the owners (and the cache's counts, given the
        mask of live reservation slots)."""
        c = self._ctl
        free = np.flatnonzero(c.page_owner == 0).astype(np.int32)
        c.page_slot[free] = -1
        c.free_stack[:len(free)] = free[::-1]   # pop order: lowest ids first
        c.hdr[H_FREE_TOP] = len(free)
        if live_slots is not None:
            self.cache.rebuild(live_slots)

    def alloc(self, n: int, owner: int, slot: int = -1, keep_free: int = 0) -> list[int]:
        """Pop ``n`` pages for ``owner`` (in reservation ``slot``, or none), leaving at
        least ``keep_free`` free, evicting cached pages when the stack runs short;
        nothing is taken if fewer are free."""
        c = self._ctl
        free = self.num_free
        if n > free - keep_free:
            held = f" ({keep_free} kept for running sequences)" if keep_free else ""
            raise PoolExhausted(f"need {n} pages, {free} free of {self.num_pages}{held}")
        top = int(c.hdr[H_FREE_TOP])
        if n > top:
            self.free(self.cache.evict(n - top))
            top = int(c.hdr[H_FREE_TOP])
        pages = c.free_stack[top - n:top][::-1].copy()
        c.page_owner[pages] = owner
        c.page_slot[pages] = slot
        c.page_seq[pages] = np.arange(n, dtype=np.int32)
        c.hdr[H_FREE_TOP] = top - n
        return pages.tolist()

    def free(self, pages) -> None:
        """Push ``pages`` back, unchecked (see :meth:`release` for a caller's pages)."""
        c = self._ctl
        pages = np.asarray(pages, dtype=np.int32)
        if not len(pages):
            return
        top = int(c.hdr[H_FREE_TOP])
        c.page_owner[pages] = 0
        c.page_slot[pages] = -1
        self.cache.cleared(pages)
        c.free_stack[top:top + len(pages)] = pages[::-1]
        c.hdr[H_FREE_TOP] = top + len(pages)

    def release(self, pages: np.ndarray, owner: int) -> None:
        """Free pages that ``owner`` holds outside any reservation; refuses (freeing
        nothing) ids out of range, duplicates and pages that are not the owner's."""
        c = self._ctl
        if len(pages) and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"page ids out of range 0..{self.num_pages - 1}")
        wrong = pages[(c.page_owner[pages] != owner) | (c.page_slot[pages] != -1)]
        if len(wrong) or len(np.unique(pages)) != len(pages):
            raise ValueError(f"pages {wrong.tolist()[:8]} are not this process's to free "
                             "(double free, or still part of a reservation?)")
        self.free(pages)

    def free_owned(self, owner: int) -> None:
        """Free every page ``owner`` holds (in reservations or not); the caller has
        ended the pins on the cache owner's pages first."""
        self.free(np.flatnonzero(self._ctl.page_owner == owner))

    def free_reserved(self, slot: int) -> None:
        """Free the pages of reservation ``slot``."""
        self.free(np.flatnonzero(self._ctl.page_slot == slot))

    def hand_over(self, slot: int, owner: int) -> list[int]:
        """Reservation ``slot``'s pages become ``owner``'s, outside any reservation;
        returned in the order :meth:`alloc` handed them out (the sender wrote the
        sequence's page j into the descriptor's j-th page, whatever its id)."""
        c = self._ctl
        pages = np.flatnonzero(c.page_slot == slot)
        pages = pages[np.argsort(c.page_seq[pages], kind="stable")]
        c.page_owner[pages] = owner
        c.page_slot[pages] = -1
        return pages.tolist()
