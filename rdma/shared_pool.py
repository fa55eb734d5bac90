"""The decode KV pool in POSIX shared memory, mapped by every process that uses it
(kv_transfer and decode): pages, reservations and counters.

:class:`SharedKVPool` puts together the pieces, one module each:

- :mod:`.pool_layout` — the files, the control file's header and arrays, mapping;
- :mod:`.pool_pages` — who holds each page, and the free stack;
- :mod:`.pool_cache` — the prefix cache: published pages, their sharers, eviction
  (found by key through the hash table of :mod:`.pool_keys`);
- :mod:`.pool_owners` — the attached processes and whether they still live;
- :mod:`.reservations` — the slots' lifecycle, generations, leases and counters.

Concurrency: every state change happens under an ``flock`` on the control file (plus
a thread lock), which the kernel releases when its holder dies. The canonical state is
the per-page owner/slot arrays; the free stack is derived from them and rebuilt if a
process died half-way through a change (the ``dirty`` flag). Each attached process
registers as an owner; any of them may run :meth:`SharedKVPool.housekeep` (a dead
owner's pages back, its reservations failed; leases expired) — kv_transfer and decode
both do, so either one dying leaves the other to clean up.

Allocation is decided under the lock (:meth:`SharedKVPool.try_alloc`), never from a
racy read of the free count; reservations leave ``headroom_pages`` free for the
decoder's running sequences.
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .errors import PoolError, PoolExhausted, ReservationGone
from .plan import ModelSpec
from .pool_cache import PrefixIndex
from .pool_layout import (H_CANCELLED, H_DIRTY, H_FAILED, H_RECLAIMED, SHM_DIR, ControlBlock,
                          KVFiles, PoolOwner, PoolSpec, pool_owner, read_spec, unlink_files)
from .pool_owners import Owners
from .pool_pages import SharedPages
from .reservations import (CANCELLED, FAILED, FAILURE_CODES, FAILURE_REASONS, FREE, INJECTED, OK,
                           OWNER_DIED, PREFILL_FAILED, READY, RESERVED, SENDER_ERROR, STATE_NAMES,
                           TIMEOUT, UNCLAIMED, Reservations, SlotStatus)
from .wire import SECRET_BYTES

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolStats:
    free: int
    reserved: int      # pages of live reservations (not yet claimed)
    in_use: int        # pages owned by processes outside reservations (claimed / allocated)
    slots_active: int
    reclaimed_owners: int
    failed_reservations: int
    cancelled_reservations: int = 0
    cached: int = 0    # pages with a prefix-cache key (free ones among them count as free)


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

    def __init__(self, spec: PoolSpec, create: bool, fail_grace_s: float = 30.0,
                 server_pid: int | None = None):
        self.spec = spec
        self._tlock = threading.RLock()
        self._closed = False
        self._ctl = ControlBlock(spec, create)
        if create:
            self._ctl.set_server(server_pid or os.getpid())
        self._cache = PrefixIndex(self._ctl, spec.num_pages, spec.max_pins)
        self._pages = SharedPages(self._ctl, spec.num_pages, self._cache)
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
    def create(cls, spec: PoolSpec, fail_grace_s: float = 30.0,
               server_pid: int | None = None) -> "SharedKVPool":
        """Create the pool's files (fails if they exist: see :meth:`open_or_create`),
        for the server ``server_pid`` (default: this process)."""
        return cls(spec, create=True, fail_grace_s=fail_grace_s, server_pid=server_pid)

    @classmethod
    def open_or_create(cls, spec: PoolSpec, server_pid: int | None = None,
                       timeout_s: float = 120.0, fail_grace_s: float = 30.0) -> "SharedKVPool":
        """The pool of server ``server_pid`` (default: this process): whichever of its
        processes comes first creates it, the others attach. A file of the same name
        left by a dead server (or by a creator that died half-way) is replaced; one a
        live server uses — or one made in another PID namespace, which cannot be
        checked — is refused with :class:`PoolError`. An existing pool must have
        ``spec``'s geometry."""
        server_pid = server_pid or os.getpid()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls.create(spec, fail_grace_s, server_pid)
            except FileExistsError:
                pass
            verdict, why = pool_owner(spec.name, server_pid)
            if verdict is PoolOwner.OURS:
                pool = cls.open(spec.name, max(0.0, deadline - time.monotonic()), fail_grace_s)
                return pool._same_geometry(spec)
            if verdict is PoolOwner.OTHER:
                raise PoolError(f"shared KV pool {spec.name!r} exists and is not this server's "
                                f"to use: {why}. Remove /dev/shm/{spec.name}.* if that is wrong")
            if verdict is PoolOwner.STALE:
                log.warning("replacing stale shared KV pool %r: %s", spec.name, why)
                unlink_files(spec.name)
            elif time.monotonic() > deadline:   # STARTING for too long
                raise PoolError(f"shared KV pool {spec.name!r}: its creator did not finish "
                                f"writing it within {timeout_s}s")
            else:
                time.sleep(0.01)

    def _same_geometry(self, spec: PoolSpec) -> "SharedKVPool":
        have, want = self.spec, spec
        if (have.models, have.num_pages, have.scheme, have.num_slots, have.context_bytes,
                have.headroom_pages, have.max_pins) != (
                    want.models, want.num_pages, want.scheme, want.num_slots, want.context_bytes,
                    want.headroom_pages, want.max_pins):
            self.close(release=False)
            raise PoolError(f"shared KV pool {spec.name!r} exists with another geometry "
                            f"({have}); expected {want}")
        return self

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
        return m.page_bytes(m.heads_per_rank(self.spec.scheme))

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
                    # its last writer died mid-change
                    self._pages.rebuild(self._slots.live())
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
        if owner == self._cache.owner:
            # the cached pages are the owner's: reservations sharing them fail first
            self._slots.fail_pinning(reason)
            self._pages.free(self._cache.set_owner(0, bytes(16)))
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

    def housekeep(self, now: float | None = None) -> int:
        """:meth:`reclaim_dead` and :meth:`expire` in one lock; any attached process may
        run it (kv_transfer and decode both do). Returns the owners reclaimed."""
        with self._locked():
            n = self._reclaim_dead_locked()
            self._slots.expire(time.monotonic() if now is None else now)
            return n

    def expire(self, now: float | None = None) -> None:
        """Lease housekeeping: unclaimed READY slots fail, FAILED slots become FREE."""
        with self._locked():
            self._slots.expire(time.monotonic() if now is None else now)

    # -- reservations (kv_transfer) ------------------------------------------------------
    def reserve(self, num_pages: int, expected_ops: int, timeout_s: float,
                secret: bytes | None = None) -> tuple[int, int, list[int]]:
        """Reserve a slot and ``num_pages`` un-evictable pages, protected by ``secret``
        (16 bytes; a random one if None): (slot, generation, pages). ``headroom_pages``
        stay free for the decoder. Raises :class:`PoolExhausted` when pages or slots run
        out (after reclaiming dead owners' and expired reservations')."""
        return self.reserve_prefix(num_pages, (), expected_ops, timeout_s, secret)[:3]

    def reserve_prefix(self, num_pages: int, keys: list[bytes], expected_ops: int,
                       timeout_s: float, secret: bytes | None = None
                       ) -> tuple[int, int, list[int], int]:
        """:meth:`reserve` for a prompt of ``num_pages`` pages whose first pages may be
        cached under ``keys`` (its hash chain, at most ``spec.max_pins``): the slot
        shares the longest cached prefix and gets fresh pages for the rest:
        (slot, generation, fresh pages, shared pages). At least one page is fresh."""
        secret = secrets.token_bytes(SECRET_BYTES) if secret is None else secret
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"secret must be {SECRET_BYTES} bytes")
        keep = self.spec.headroom_pages
        with self._locked():
            shared = self._cache.chain(list(keys)[:min(num_pages - 1, self.spec.max_pins)])
            fresh = num_pages - len(shared)
            if fresh > self._pages.num_free - keep:
                self._reclaim_dead_locked()
                self._slots.expire(time.monotonic())
                shared = self._cache.chain(list(keys)[:len(shared)])   # may have changed
                fresh = num_pages - len(shared)
            slot, gen, pages = self._slots.reserve(fresh, expected_ops, timeout_s, self._me,
                                                   secret, keep, shared)
            return slot, gen, pages, len(shared)

    def max_reservable_pages(self) -> int:
        """The most pages one reservation can ever get (the pool less its headroom)."""
        return self.spec.num_pages - self.spec.headroom_pages

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

    def doom(self, slot: int, generation: int, reason: int) -> bool:
        """Fail a RESERVED reservation for its decoder now, its pages kept until
        :meth:`fail` (receives into them are still posted)."""
        with self._locked():
            return self._slots.doom(slot, generation, reason)

    def cancel_requested(self, slot: int, generation: int) -> bool:
        """Lock-free: whether the decoder gave this RESERVED reservation up."""
        return self._slots.cancel_requested(slot, generation)

    def owned_reservations(self) -> list[int]:
        """Slots of this process's live (RESERVED or READY) reservations."""
        with self._locked():
            return self._slots.owned(self._me)

    # -- the decoder's side --------------------------------------------------------------
    def poll(self, slot: int, generation: int) -> SlotStatus:
        """Lock-free read of a reservation; a reused slot (or one out of range) reads as
        FAILED(CANCELLED)."""
        return self._slots.poll(slot, generation)

    def verify(self, slot: int, generation: int, secret: bytes) -> bool:
        """Whether ``secret`` is reservation (slot, generation)'s (lock-free)."""
        return self._slots.verify(slot, generation, secret)

    def claim(self, slot: int, generation: int, secret: bytes | None = None) -> list[int]:
        """Take over a READY reservation's pages (they become this process's pages), in
        the order :meth:`reserve` handed them out; with ``secret``, only if it is the
        reservation's."""
        with self._locked():
            return self._slots.claim(slot, generation, self._me, secret)

    def cancel(self, slot: int, generation: int, secret: bytes) -> bool:
        """Give a reservation up (the request went away): a READY one is freed now, a
        RESERVED one as soon as its receiver has no receive in flight into it (it stops
        taking data and tells the sender). Whether it was live and the secret right."""
        with self._locked():
            if not self._slots.verify(slot, generation, secret):
                return False
            return self._slots.cancel(slot, generation)

    def alloc(self, n: int) -> list[int]:
        """Pages for this process outside any reservation (e.g. decode growth)."""
        with self._locked():
            return self._pages.alloc(n, self._me)

    def try_alloc(self, n: int) -> list[int] | None:
        """:meth:`alloc`, or None when fewer than ``n`` pages are free (decided under
        the lock: no other process can take them in between)."""
        with self._locked():
            if n > self._pages.num_free:
                return None
            return self._pages.alloc(n, self._me)

    def free(self, pages) -> None:
        pages = np.asarray(list(pages), dtype=np.int64)
        with self._locked():
            self._pages.release(pages, self._me)

    # -- the prefix cache (pool_cache.py) -----------------------------------------------
    @property
    def caching(self) -> bool:
        """Whether this pool has a prefix cache (``spec.max_pins`` > 0)."""
        return self._cache.enabled

    def cache_root(self) -> bytes | None:
        """The model key the cache's owner roots its chains at (None: no owner)."""
        with self._locked():
            return self._cache.root if self._cache.owner else None

    def cache_lookup(self, keys: list[bytes]) -> int:
        """How many of ``keys``' first pages are cached (nothing is taken)."""
        with self._locked():
            return len(self._cache.chain(list(keys)))

    def cache_pages(self, keys: list[bytes]) -> list[int]:
        """The pages of ``keys``' longest cached prefix (nothing is taken: for
        inspection, e.g. a test that corrupts one)."""
        with self._locked():
            return [int(p) for p in self._cache.chain(list(keys))]

    def become_cache_owner(self, root: bytes) -> None:
        """This process publishes from now on, its chains rooted at ``root`` (its model
        and version); what a previous owner cached is dropped, and reservations that
        share its pages fail (a rolled version shares nothing with the old)."""
        with self._locked():
            self._slots.fail_pinning(CANCELLED)
            self._pages.free(self._cache.set_owner(self._me, root))

    def _owning_cache(self) -> bool:
        return self._cache.owner == self._me

    def cache_match(self, keys: list[bytes]) -> list[int]:
        """The owner takes (holds) the pages of the longest cached prefix of ``keys``."""
        with self._locked():
            if not self._owning_cache():
                return []
            pages = self._cache.chain(list(keys))
            self._cache.hold(pages)
            return pages

    def cache_free(self, pages) -> None:
        """The owner's last hold on each of ``pages`` ended: cached ones stay (evictable),
        the others are freed."""
        pages = np.asarray(list(pages), dtype=np.int64)
        with self._locked():
            self._pages.release(self._cache.unhold(pages), self._me)

    def cache_publish(self, page: int, key: bytes) -> bool:
        """Cache the owner's held ``page`` (its KV complete) under ``key``; False when
        the key is cached already, or this process no longer owns the cache."""
        with self._locked():
            return self._owning_cache() and self._cache.publish(page, key)

    def cache_drop(self, pages) -> int:
        """Unpublish those of ``pages`` only the owner holds (their sequence failed)."""
        with self._locked():
            return self._cache.drop(pages) if self._owning_cache() else 0

    def cache_reset(self) -> int:
        """Drop every key (held pages stay with their holders); returns how many pages
        were cached."""
        with self._locked():
            n = self._cache.num_cached()
            self._pages.free(self._cache.reset())
            return n

    @property
    def cache_evictions(self) -> int:
        """Evictions since the pool was made (a racy read of one counter, no lock)."""
        return self._cache.evictions()

    def cache_counts(self) -> tuple[int, int]:
        """(pages cached, evictions since the pool was made)."""
        with self._locked():
            return self._cache.num_cached(), self._cache.evictions()

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    def backlog(self) -> tuple[int, int]:
        """``(reservations, pages)`` still RESERVED: KV the prefill side has yet to
        deliver (a doomed one will deliver nothing). Read without the lock: a hint (for
        routing), not a decision."""
        reserved = (self._ctl.slot_state == RESERVED) & (self._ctl.slot_error == OK)
        return int(reserved.sum()), int(self._ctl.slot_pages[reserved].sum())

    def stats(self) -> PoolStats:
        with self._locked():
            free, reserved = self._pages.num_free, self._pages.num_reserved()
            hdr = self._ctl.hdr
            return PoolStats(free, reserved, self.spec.num_pages - free - reserved,
                             self._slots.num_active(), int(hdr[H_RECLAIMED]), int(hdr[H_FAILED]),
                             int(hdr[H_CANCELLED]), self._cache.num_cached())


class SharedPageAllocator:
    """The engine's page-allocator interface (``num_pages``, ``num_free``, ``num_used``,
    ``can_alloc``, ``try_alloc``, ``alloc``, ``free``) over a shared pool, for the decode
    process: its own allocations plus claimed reservations. kv_transfer reserves from
    the same pool in another process, so ``can_alloc`` is only a hint: the engine
    allocates with ``try_alloc``, decided under the pool's lock. ``alloc`` raises
    :class:`PoolExhausted` when too few pages are free.

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

    def try_alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        return self.pool.try_alloc(n)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        return self.pool.alloc(n)

    def free(self, pages: list[int]) -> None:
        self.pool.free(pages)

    def adopt(self, pages: list[int]) -> None:
        """Pages a claimed reservation handed over: the pool made them this process's."""


__all__ = [
    "SharedKVPool", "SharedPageAllocator", "PoolSpec", "PoolStats", "SlotStatus",
    "PoolError", "PoolExhausted", "ReservationGone", "SHM_DIR",
    "FREE", "RESERVED", "READY", "FAILED", "STATE_NAMES",
    "OK", "TIMEOUT", "SENDER_ERROR", "UNCLAIMED", "OWNER_DIED", "CANCELLED", "INJECTED", "PREFILL_FAILED",
    "FAILURE_REASONS", "FAILURE_CODES",
]
