"""Page allocator: free list, reference counts, pinned (un-evictable) pages.

Pure bookkeeping over page ids; it never touches KV memory.
"""
from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Not enough free pages; nothing was allocated."""


class PageAllocator:
    """All-or-nothing allocation of page ids ``0 .. num_pages-1``.

    >>> a = PageAllocator(4)
    >>> pages = a.alloc(3); a.num_free
    1
    >>> a.free(pages); a.num_free
    4
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._pinned = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_pinned(self) -> int:
        return sum(self._pinned)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int, pinned: bool = False) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
            self._pinned[p] = pinned
        return pages

    def share(self, pages: list[int]) -> None:
        """Another owner holds these pages (prefix sharing, forks)."""
        for p in pages:
            self._check_live(p)
        for p in pages:
            self._refcount[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference per page; a page returns to the free list at zero."""
        for p in pages:
            self._check_live(p)
            if self._pinned[p] and self._refcount[p] == 1:
                raise ValueError(f"page {p} is pinned; unpin it before its last free")
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def pin(self, pages: list[int]) -> None:
        for p in pages:
            self._check_live(p)
            self._pinned[p] = True

    def unpin(self, pages: list[int]) -> None:
        for p in pages:
            self._check_live(p)
            self._pinned[p] = False

    def is_pinned(self, page: int) -> bool:
        return self._pinned[page]

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def _check_live(self, p: int) -> None:
        if not 0 <= p < self.num_pages:
            raise ValueError(f"page id {p} out of range 0..{self.num_pages - 1}")
        if self._refcount[p] == 0:
            raise ValueError(f"page {p} is not allocated (double free?)")
