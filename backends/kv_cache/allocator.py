"""Page allocators: which page ids are free. Pure bookkeeping; never touches KV memory.

:class:`KVAllocator` is what the engine's scheduler needs of one; the engine's own
:class:`PageAllocator` and the shared decode pool's allocator (``tandem.rdma``)
both provide it.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol, runtime_checkable


class OutOfPages(RuntimeError):
    """Not enough free pages; nothing was allocated."""


@runtime_checkable
class KVAllocator(Protocol):
    """All-or-nothing allocation of page ids ``0 .. num_pages-1``.

    ``try_alloc(n)`` is the one to allocate with: it decides and takes in one step
    (``None`` when fewer than ``n`` are free). With a pool shared between processes
    (the decode pool, which kv_transfer reserves from) ``can_alloc`` is only a hint —
    another process may take the pages in between — and ``alloc`` raises
    :class:`OutOfPages` (or the pool's own error) when there are not ``n`` free."""
    num_pages: int

    @property
    def num_free(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    def can_alloc(self, n: int) -> bool: ...

    def try_alloc(self, n: int) -> list[int] | None: ...

    def alloc(self, n: int) -> list[int]: ...

    def free(self, pages: list[int]) -> None: ...


class PageAllocator:
    """One process's free list.

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
        self._allocated = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def try_alloc(self, n: int) -> list[int] | None:
        return self.alloc(n) if n <= len(self._free) else None

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._allocated[p] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page id {p} out of range 0..{self.num_pages - 1}")
            if not self._allocated[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} list a page twice (double free?)")
        for p in pages:
            self._allocated[p] = False
            self._free.append(p)
