"""The shared pool's prefix cache: which pages hold a published prompt prefix, who
shares them, and which to evict first.

One process, the cache's *owner* (decode), publishes full pages whose KV is complete
under their hash-chain key and holds them for its sequences; kv_transfer, in another
process, looks a prompt up and *pins* the pages of its longest cached prefix into the
reservation it makes, so it reserves (and prefill sends) only the pages decode lacks.
A claim turns the pins into the owner's holds. All of it lives in the control block,
under the pool's lock, beside the page owners:

- ``page_cached`` / ``page_key``: a page's key once published (never on a free page),
  found by key through the hash table of :mod:`.pool_keys` (``key_table``), which
  holds exactly the cached pages;
- ``page_held``: the owner holds the page for one of its sequences (it counts how many
  in its own memory);
- ``page_pins``: live reservations sharing it, each listing its pins in ``slot_pins``;
- a cached page nobody holds or pins is *evictable*: it stays the owner's, counts as
  free for allocation, and gives up its key (least recently freed first, by
  ``page_stamp``) only when an allocation finds the free stack empty.

A page is handed out, evicted or rewritten only while nobody holds or pins it. The
counts and the key table derive from the canonical arrays (:meth:`PrefixIndex.rebuild`),
so a process dying mid-change loses nothing. A key is cached at most once, so a lookup
is one probe of the table per key, whatever the pool's size.
"""
from __future__ import annotations

import numpy as np

from .pool_keys import KeyTable
from .pool_layout import H_CACHE_OWNER, H_CLOCK, H_EVICTABLE, H_EVICTIONS, H_ROOT0, H_ROOT1, ControlBlock

KEY_BYTES = 16


def key_words(key: bytes) -> tuple[int, int]:
    """A 16-byte key as the two little-endian uint64 words the control block stores."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a page key has {KEY_BYTES} bytes, got {len(key)}")
    a, b = np.frombuffer(key, dtype="<u8")
    return int(a), int(b)


class PrefixIndex:
    """The cache arrays of a :class:`~.pool_layout.ControlBlock`. Every method expects
    the pool's lock, except :attr:`num_evictable` (a racy read)."""

    def __init__(self, ctl: ControlBlock, num_pages: int, max_pins: int):
        self._ctl, self.num_pages, self.max_pins = ctl, num_pages, max_pins
        self._keys = KeyTable(ctl)

    @property
    def enabled(self) -> bool:
        return self.max_pins > 0

    @property
    def num_evictable(self) -> int:
        return int(self._ctl.hdr[H_EVICTABLE])

    @property
    def owner(self) -> int:
        """The owner id of the process that publishes (0: none)."""
        return int(self._ctl.hdr[H_CACHE_OWNER])

    @property
    def root(self) -> bytes:
        """The owner's model key (its fingerprint and version): every chain starts from
        it, so a lookup made by another process keys pages as the owner did."""
        h = self._ctl.hdr
        return np.array([h[H_ROOT0], h[H_ROOT1]], dtype=np.int64).tobytes()

    def num_cached(self) -> int:
        return int(self._ctl.page_cached.sum())

    def evictions(self) -> int:
        return int(self._ctl.hdr[H_EVICTIONS])

    # -- who publishes ----------------------------------------------------------------
    def set_owner(self, owner: int, root: bytes) -> list[int]:
        """``owner`` publishes from now on, its chains rooted at ``root``; what the
        previous owner cached is dropped (a new model version shares nothing with the
        old). Returns the evictable pages, to be freed by the caller."""
        freed = self.reset()
        c = self._ctl
        r = np.frombuffer(root, dtype=np.int64)
        c.hdr[H_ROOT0], c.hdr[H_ROOT1] = int(r[0]), int(r[1])
        c.hdr[H_CACHE_OWNER] = owner
        return freed

    def _evictable_mask(self, pages=slice(None)) -> np.ndarray:
        """Which of ``pages`` (default: all) are cached and unused by anyone."""
        c = self._ctl
        return ((c.page_cached[pages] == 1) & (c.page_held[pages] == 0)
                & (c.page_pins[pages] == 0) & (c.page_owner[pages] != 0))

    # -- lookups ----------------------------------------------------------------------
    def find(self, key: bytes) -> int:
        """The page cached under ``key``, or -1."""
        return self._keys.find(*key_words(key))

    def chain(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of ``keys`` (nothing is taken)."""
        pages = []
        for key in keys:
            p = self.find(key)
            if p < 0:
                break
            pages.append(p)
        return pages

    # -- the owner's holds ------------------------------------------------------------
    def hold(self, pages) -> None:
        """The owner holds ``pages`` (cached ones stop being evictable)."""
        c = self._ctl
        pages = np.asarray(pages, dtype=np.int64)
        was = self._evictable_mask(pages)
        c.page_held[pages] = 1
        c.hdr[H_EVICTABLE] -= int(was.sum())

    def unhold(self, pages) -> np.ndarray:
        """The owner no longer holds ``pages``; returns those that are not cached (the
        caller frees them). Cached ones nobody pins become evictable."""
        c = self._ctl
        pages = np.asarray(pages, dtype=np.int64)
        c.page_held[pages] = 0
        cached = c.page_cached[pages] == 1
        now_evictable = pages[cached & (c.page_pins[pages] == 0)]
        self._stamp(now_evictable)
        c.hdr[H_EVICTABLE] += len(now_evictable)
        return pages[~cached]

    def publish(self, page: int, key: bytes) -> bool:
        """Cache ``page``, which the owner holds outside any reservation, under ``key``;
        False when the key is cached already (another sequence computed the same page)
        or the page has a key."""
        c = self._ctl
        if c.page_owner[page] != self.owner or c.page_slot[page] != -1:
            raise ValueError(f"page {page} is not held by the cache's owner; only a held "
                             "page is published")
        if c.page_cached[page] or self.find(key) >= 0:
            return False
        c.page_keys[page] = key_words(key)
        c.page_cached[page] = 1
        c.page_held[page] = 1
        self._keys.insert(page)
        return True

    def drop(self, pages) -> int:
        """Unpublish those of ``pages`` the owner holds and no reservation pins (their
        sequence failed); returns how many."""
        c = self._ctl
        pages = np.asarray(pages, dtype=np.int64)
        mask = (c.page_cached[pages] == 1) & (c.page_held[pages] == 1) & (c.page_pins[pages] == 0)
        self._uncache(pages[mask])
        return int(mask.sum())

    def reset(self) -> list[int]:
        """Every key dropped; held and pinned pages stay with their holders. Returns
        the pages that were evictable (now plain pages of their owner: the caller frees
        them)."""
        c = self._ctl
        evictable = np.flatnonzero(self._evictable_mask())
        c.page_cached[:] = 0
        self._keys.clear()
        c.hdr[H_EVICTABLE] = 0
        return evictable.tolist()

    # -- reservations' pins ------------------------------------------------------------
    def pin(self, slot: int, pages: list[int]) -> None:
        """Reservation ``slot`` shares ``pages`` (cached, found under the same lock)."""
        if len(pages) > self.max_pins:
            raise ValueError(f"{len(pages)} pins; a reservation holds at most {self.max_pins}")
        c = self._ctl
        arr = np.asarray(pages, dtype=np.int64)
        was = self._evictable_mask(arr)
        c.pins[slot, :len(arr)] = arr
        c.slot_num_pins[slot] = len(arr)
        np.add.at(c.page_pins, arr, 1)
        c.hdr[H_EVICTABLE] -= int(was.sum())

    def pinned(self, slot: int) -> list[int]:
        c = self._ctl
        return c.pins[slot, :int(c.slot_num_pins[slot])].tolist()

    def unpin(self, slot: int, to_owner: bool) -> list[int]:
        """End reservation ``slot``'s pins: with ``to_owner`` its claimer (the owner)
        holds them now; else they may become evictable. Returns the pages."""
        c = self._ctl
        pages = np.asarray(self.pinned(slot), dtype=np.int64)
        c.slot_num_pins[slot] = 0
        if not len(pages):
            return []
        np.add.at(c.page_pins, pages, -1)
        if to_owner:
            c.page_held[pages] = 1
        else:
            now = pages[self._evictable_mask(pages)]
            self._stamp(now)
            c.hdr[H_EVICTABLE] += len(now)
        return pages.tolist()

    # -- eviction -----------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Take the keys of the ``n`` least recently freed evictable pages (the caller
        frees them); fewer if fewer are evictable."""
        c = self._ctl
        cand = np.flatnonzero(self._evictable_mask())
        if n <= 0 or not len(cand):
            return []
        if n < len(cand):
            cand = cand[np.argpartition(c.page_stamp[cand], n - 1)[:n]]
        self._uncache(cand)
        c.hdr[H_EVICTABLE] -= len(cand)
        c.hdr[H_EVICTIONS] += len(cand)
        return cand.tolist()

    def cleared(self, pages: np.ndarray) -> None:
        """``pages`` went back to the free stack: no key, hold or pin stays on them."""
        self._uncache(pages)
        self._ctl.page_held[pages] = 0

    def _uncache(self, pages: np.ndarray) -> None:
        """Those of ``pages`` that are cached lose their key."""
        c = self._ctl
        for p in np.unique(pages[c.page_cached[pages] == 1]).tolist():
            self._keys.remove(p)
            c.page_cached[p] = 0

    def _stamp(self, pages: np.ndarray) -> None:
        c = self._ctl
        clock = int(c.hdr[H_CLOCK])
        c.page_stamp[pages] = np.arange(clock, clock + len(pages))
        c.hdr[H_CLOCK] = clock + len(pages)

    def rebuild(self, live: np.ndarray) -> None:
        """Derive the pin counts from the lists of the live reservations (``live``: a
        mask over slots) and the evictable count from the arrays (a process died
        mid-change)."""
        c = self._ctl
        c.slot_num_pins[~live] = 0
        c.page_pins[:] = 0
        c.page_cached[c.page_owner == 0] = 0
        c.page_held[c.page_owner == 0] = 0
        self._keys.rebuild(np.flatnonzero(c.page_cached == 1))
        for slot in np.flatnonzero(live):
            np.add.at(c.page_pins, np.asarray(self.pinned(int(slot)), dtype=np.int64), 1)
        c.hdr[H_EVICTABLE] = int(self._evictable_mask().sum())
