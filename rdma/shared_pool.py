"""The decode KV pool in POSIX shared memory, mapped by every process that uses it
(kv_transfer and decode): pages, reservations and counters.

:class:`SharedKVPool` puts together the pieces, one module each:

- :mod:`.pool_layout` — the files, the control file's header and arrays, mapping;
- :mod:`.pool_pages` — who holds each page, and the free stack;
- :mod:`.pool_owners` — the attached processes and whether they still live;
- :mod:`.reservations` — the slots' lifecycle, generations, leases and counters.

Concurrency: every state change happens under an ``flock`` on the control file (plus
a thread lock), which the kernel releases when its holder dies. The canonical state is
the per-page owner/slot arrays; the free stack is derived from them and rebuilt if a
process died half-way through a change (the ``dirty`` flag). Each attached process
registers as an owner; :meth:`SharedKVPool.reclaim_dead` returns a dead owner's pages
and fails its reservations.
"""
from __future__ import annotations

import fcntl
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .errors import PoolError, PoolExhausted, ReservationGone
from .plan import ModelSpec
from .pool_layout import (H_DIRTY, H_FAILED, H_RECLAIMED, SHM_DIR, ControlBlock, KVFiles,
                          PoolSpec, read_spec, unlink_files)
from .pool_owners import Owners
from .pool_pages import SharedPages
from .reservations import (CANCELLED, FAILED, FAILURE_CODES, FAILURE_REASONS, FREE, OK,
                           OWNER_DIED, READY, RESERVED, SENDER_ERROR, STATE_NAMES, TIMEOUT,
                           UNCLAIMED, Reservations, SlotStatus)


@dataclass(frozen=True, slots=True)
class PoolStats:
    free: int
    reserved: int      # pages of live reservations (not yet claimed)
    in_use: int        # pages owned by processes outside reservations (claimed / allocated)
    slots_active: int
    reclaimed_owners: int
    failed_reservations: int


class SharedKVPool:
    """A decode KV pool shared by processes; see the module docstring.

    >>> from tandem.rdma.plan import ModelSpec
    >>> spec = PoolSpec("doc-pool", (ModelSpec("target", 2, 2, 8, 4, "float32"),), num_pages=8)
    >>> pool = SharedKVPool.create(spec)
    >>> slot, gen, pages = pool.reserve(3, expected_ops=6, timeout_s=5)
    >>> pool.stats().reserved, pool.poll(slot, gen).state == RESERVED
    (3, True)
    >>> pool.fail(slot, gen, CANCELLED), pool.stats().free
    (True, 8)
    >>> pool.close(unlink_if_last=True)
    True
    """

    def __init__(self, spec: PoolSpec, create: bool, fail_grace_s: float = 30.0):
        self.spec = spec
        self._tlock = threading.RLock()
        self._closed = False
        self._ctl = ControlBlock(spec, create)
        self._pages = SharedPages(self._ctl, spec.num_pages)
        self._slots = Reservations(self._ctl, self._pages, spec.num_slots, fail_grace_s)
        self._owners = Owners(self._ctl, spec.max_owners, spec.name)
        if create:
            self._pages.reset()
            self._slots.reset()
        self._kv = KVFiles(spec, create)
        if create:
            self._ctl.publish()   # last: openers wait for a complete pool
        with self._locked():
            self._reclaim_dead_locked()
            self._me = self._owners.register()

    # -- construction --------------------------------------------------------------------
    @classmethod
    def create(cls, spec: PoolSpec, fail_grace_s: float = 30.0) -> "SharedKVPool":
        """Create the pool's files (fails if they exist: see :meth:`unlink_stale`)."""
        return cls(spec, create=True, fail_grace_s=fail_grace_s)

    @classmethod
    def open(cls, name: str, timeout_s: float = 10.0, fail_grace_s: float = 30.0) -> "SharedKVPool":
        """Map a pool another process created (waits for it to be initialised)."""
        return cls(read_spec(name, timeout_s), create=False, fail_grace_s=fail_grace_s)

    @classmethod
    def unlink_stale(cls, name: str) -> None:
        """Remove a pool's files (e.g. left by a crashed run with the same name)."""
        unlink_files(name)

    @property
    def fail_grace_s(self) -> float:
        """How long a failed reservation stays FAILED (readable) before its slot is FREE."""
        return self._slots.fail_grace_s

    @fail_grace_s.setter
    def fail_grace_s(self, value: float) -> None:
        self._slots.fail_grace_s = value

    def close(self, release: bool = True, unlink_if_last: bool = False) -> bool:
        """Detach; with ``release`` return this process's pages and fail its reservations.
        With ``unlink_if_last`` the pool's files go too when no other live process is
        attached (when a model version unloads while a newer one keeps the pool, the
        files must stay for the newer one's processes). Returns whether it unlinked."""
        if self._closed:
            return False
        unlinked = False
        if release or unlink_if_last:
            with self._locked():
                if release:
                    self._release_owner_locked(self._me, OWNER_DIED)
                else:
                    self._owners.remove(self._me)
                if unlink_if_last:
                    self._reclaim_dead_locked()
                    if not self._owners.num_attached():
                        self.unlink()
                        unlinked = True
        self._closed = True
        self._kv.close()
        self._ctl.close()
        return unlinked

    def unlink(self) -> None:
        self.unlink_stale(self.spec.name)

    # -- memory --------------------------------------------------------------------------
    def kv(self, rank: int, model: str) -> np.ndarray:
        """Flat bytes of one decode rank's KV pool of one model, laid out as the
        engine's ``[layers, pages, *page_shape]``."""
        return self._kv[rank, model]

    def model(self, name: str) -> ModelSpec:
        for m in self.spec.models:
            if m.name == name:
                return m
        raise KeyError(f"model {name!r} not in pool {self.spec.name!r}")

    def page_bytes(self, model: str) -> int:
        m = self.model(model)
        return m.page_bytes(self.spec.scheme.heads_per_rank(m.num_kv_heads))

    def layer_bytes(self, model: str) -> int:
        return self.page_bytes(model) * self.spec.num_pages

    def context(self, slot: int) -> np.ndarray:
        return self._ctl.slot_ctx[slot]

    # -- locking and recovery ------------------------------------------------------------
    @contextmanager
    def _locked(self):
        if self._closed:
            raise PoolError("pool is closed")
        hdr = self._ctl.hdr
        with self._tlock:
            fcntl.flock(self._ctl.fd, fcntl.LOCK_EX)
            try:
                if hdr[H_DIRTY]:
                    self._pages.rebuild()   # its last writer died mid-change
                hdr[H_DIRTY] = 1
                try:
                    yield
                finally:
                    # errors raised in-process come before any change; only a death
                    # mid-change leaves the flag set
                    hdr[H_DIRTY] = 0
            finally:
                fcntl.flock(self._ctl.fd, fcntl.LOCK_UN)

    def _release_owner_locked(self, owner: int, reason: int) -> None:
        self._slots.fail_owned(owner, reason)
        self._pages.free_owned(owner)
        self._owners.remove(owner)

    def _reclaim_dead_locked(self) -> int:
        dead = self._owners.dead()
        for owner in dead:
            self._release_owner_locked(owner, OWNER_DIED)
            self._ctl.hdr[H_RECLAIMED] += 1
        return len(dead)

    def reclaim_dead(self) -> int:
        """Return the pages and fail the reservations of owners whose process died."""
        with self._locked():
            return self._reclaim_dead_locked()

    def expire(self, now: float | None = None) -> None:
        """Lease housekeeping: unclaimed READY slots fail, FAILED slots become FREE."""
        with self._locked():
            self._slots.expire(time.monotonic() if now is None else now)

    # -- reservations (kv_transfer) ------------------------------------------------------
    def reserve(self, num_pages: int, expected_ops: int,
                timeout_s: float) -> tuple[int, int, list[int]]:
        """Reserve a slot and ``num_pages`` un-evictable pages: (slot, generation, pages).
        Raises :class:`PoolExhausted` when pages or slots run out (after reclaiming
        dead owners' and expired reservations')."""
        with self._locked():
            if not self._slots.has_free_slot() or num_pages > self._pages.num_free:
                self._reclaim_dead_locked()
                self._slots.expire(time.monotonic())
            return self._slots.reserve(num_pages, expected_ops, timeout_s, self._me)

    def arm(self, slot: int, generation: int, expected_ops: int) -> None:
        """Set the number of operations a RESERVED slot's counter expects."""
        with self._locked():
            self._slots.arm(slot, generation, expected_ops)

    def add_completed(self, slot: int, n: int = 1) -> int:
        """Advance a RESERVED slot's counter (its receiver is the only writer)."""
        return self._slots.add_completed(slot, n)

    def mark_ready(self, slot: int, generation: int, claim_lease_s: float) -> bool:
        with self._locked():
            return self._slots.mark_ready(slot, generation, claim_lease_s)

    def fail(self, slot: int, generation: int, reason: int) -> bool:
        """Fail a live reservation and free its pages. The caller guarantees that no
        receive into them is still in flight."""
        with self._locked():
            return self._slots.fail(slot, generation, reason)

    # -- the decoder's side --------------------------------------------------------------
    def poll(self, slot: int, generation: int) -> SlotStatus:
        """Lock-free read of a reservation; a reused slot reads as FAILED(CANCELLED)."""
        return self._slots.poll(slot, generation)

    def claim(self, slot: int, generation: int) -> list[int]:
        """Take over a READY reservation's pages (they become this process's pages), in
        the order :meth:`reserve` handed them out."""
        with self._locked():
            return self._slots.claim(slot, generation, self._me)

    def alloc(self, n: int) -> list[int]:
        """Pages for this process outside any reservation (e.g. decode growth)."""
        with self._locked():
            return self._pages.alloc(n, self._me)

    def free(self, pages) -> None:
        pages = np.asarray(list(pages), dtype=np.int64)
        with self._locked():
            self._pages.release(pages, self._me)

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    def stats(self) -> PoolStats:
        with self._locked():
            free, reserved = self._pages.num_free, self._pages.num_reserved()
            hdr = self._ctl.hdr
            return PoolStats(free, reserved, self.spec.num_pages - free - reserved,
                             self._slots.num_active(), int(hdr[H_RECLAIMED]), int(hdr[H_FAILED]))


class SharedPageAllocator:
    """The engine's page-allocator interface (``num_pages``, ``num_free``, ``num_used``,
    ``can_alloc``, ``alloc``, ``free``) over a shared pool, for the decode process: its
    own allocations plus claimed reservations. ``alloc`` raises :class:`PoolExhausted`
    when too few pages are free; the engine asks ``can_alloc`` first.

    >>> from tandem.rdma.plan import ModelSpec
    >>> pool = SharedKVPool.create(PoolSpec("doc-alloc", (ModelSpec("t", 1, 1, 4, 2, "uint8"),), 4))
    >>> a = SharedPageAllocator(pool)
    >>> pages = a.alloc(3); a.num_free
    1
    >>> a.free(pages); a.num_free
    4
    >>> pool.close(unlink_if_last=True)
    True
    """

    def __init__(self, pool: SharedKVPool):
        self.pool = pool
        self.num_pages = pool.spec.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self.pool.num_free

    def can_alloc(self, n: int) -> bool:
        return n <= self.pool.num_free

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        return self.pool.alloc(n)

    def free(self, pages: list[int]) -> None:
        self.pool.free(pages)


__all__ = [
    "SharedKVPool", "SharedPageAllocator", "PoolSpec", "PoolStats", "SlotStatus",
    "PoolError", "PoolExhausted", "ReservationGone", "SHM_DIR",
    "FREE", "RESERVED", "READY", "FAILED", "STATE_NAMES",
    "OK", "TIMEOUT", "SENDER_ERROR", "UNCLAIMED", "OWNER_DIED", "CANCELLED",
    "FAILURE_REASONS", "FAILURE_CODES",
]
