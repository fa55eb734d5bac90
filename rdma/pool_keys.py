"""The shared pool's key -> page index: a hash table in the control file, so that a
prefix-cache lookup costs the same whatever the pool's size, in every process that
maps the pool (decode publishes; kv_transfer looks prompts up and evicts).

Open addressing with linear probing over ``key_table`` (a power of two, at least twice
the pages, so it is never more than half full); an entry is a page id plus one (0:
empty), and the key is the page's own ``page_key``. Removal shifts the entries after
it back (no tombstones), so a probe ends at the first empty entry. The table holds
exactly the cached pages; it is derived state, rebuilt from ``page_cached`` and
``page_key`` when a process died mid-change (:meth:`KeyTable.rebuild`).

>>> from types import SimpleNamespace
>>> ctl = SimpleNamespace(key_table=np.zeros(8, np.int32), page_keys=np.zeros((4, 2), np.uint64))
>>> t = KeyTable(ctl)
>>> ctl.page_keys[2] = (7, 9); t.insert(2)
>>> t.find(7, 9), t.find(7, 8)
(2, -1)
>>> t.remove(2); t.find(7, 9)
-1
"""
from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1


def key_table_size(num_pages: int) -> int:
    """Entries of a pool's table: the power of two at or above twice its pages."""
    return 1 << (2 * num_pages - 1).bit_length()


class KeyTable:
    """The table of a control block (``ctl.key_table`` over ``ctl.page_keys``); every
    method expects the pool's lock. A key is two uint64 words (``a``, ``b``)."""

    def __init__(self, ctl):
        self._ctl = ctl

    def _home(self, a: int, b: int, mask: int) -> int:
        # keys are hash-chain digests, but mix anyway: test keys are small integers
        h = ((a * 0x9E3779B97F4A7C15 + b) & _M64) * 0xBF58476D1CE4E5B9 & _M64
        return (h >> 32) & mask

    def _page_home(self, page: int, mask: int) -> int:
        a, b = self._ctl.page_keys[page]
        return self._home(int(a), int(b), mask)

    def find(self, a: int, b: int) -> int:
        """The page whose key is (``a``, ``b``), or -1."""
        table, keys = self._ctl.key_table, self._ctl.page_keys
        mask = len(table) - 1
        i = self._home(a, b, mask)
        while (e := int(table[i])):
            k = keys[e - 1]
            if int(k[0]) == a and int(k[1]) == b:
                return e - 1
            i = (i + 1) & mask
        return -1

    def insert(self, page: int) -> None:
        """Index ``page`` under its ``page_key`` (the caller checked the key is new)."""
        table = self._ctl.key_table
        mask = len(table) - 1
        i = self._page_home(page, mask)
        while table[i]:
            i = (i + 1) & mask
        table[i] = page + 1

    def remove(self, page: int) -> None:
        """Drop ``page`` (indexed under its ``page_key``, which has not changed since)."""
        table = self._ctl.key_table
        mask = len(table) - 1
        i = self._page_home(page, mask)
        while int(table[i]) != page + 1:
            if not table[i]:
                raise KeyError(f"page {page} is not in the prefix cache's index")
            i = (i + 1) & mask
        # shift back each later entry of the run whose home is not in (i, j]
        j = i
        while True:
            j = (j + 1) & mask
            e = int(table[j])
            if not e:
                break
            home = self._page_home(e - 1, mask)
            if (home <= i < j) or (i < j < home) or (j < home <= i):
                table[i] = e
                i = j
        table[i] = 0

    def clear(self) -> None:
        self._ctl.key_table[:] = 0

    def rebuild(self, cached) -> None:
        """Index exactly the pages ``cached``."""
        self.clear()
        for p in cached:
            self.insert(int(p))
