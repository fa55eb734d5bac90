"""The decode KV pool in POSIX shared memory, with its page allocator, reservations
and counters, mapped by every process that uses it (kv_transfer and decode).

Files under ``/dev/shm``: ``{name}.ctl`` holds the allocator state, the reservation
slots (state, generation, lease, expected and completed operation counts) and each
slot's context buffer; ``{name}.r{rank}.{model}`` holds one decode rank's KV pool of
one model, laid out exactly as :class:`tandem.backends.kv_cache.KVPagePool`
(``[layers, pages, *page_shape]``), so it backs one with ``buffer=``.

Concurrency: every state change happens under an ``flock`` on the control file (plus
a thread lock), which the kernel releases when its holder dies. The canonical state is
the per-page owner/slot arrays; the free stack is derived from them and rebuilt if a
process died half-way through a change (the ``dirty`` flag). Each attached process
registers as an owner (pid + start time, so a reused pid is not mistaken for the
dead one); :meth:`SharedKVPool.reclaim_dead` returns a dead owner's pages and fails its
reservations.

A slot's lifecycle: FREE -> RESERVED (kv_transfer, receives in flight) -> READY (all
operations completed) -> claimed by decode (pages change owner, slot FREE again); or
-> FAILED (timeout, sender error, unclaimed, owner died), pages freed at once, slot
kept FAILED for ``fail_grace_s`` so the decoder can read why, then FREE. The
generation increments on every reservation of a slot, and everything that names a
reservation names (slot, generation).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .plan import ModelSpec, ShardScheme
from .wire import MAX_SLOTS, Reader, decode_models, encode_models

SHM_DIR = "/dev/shm"
_MAGIC = 0x314C4F4F50564B54   # "TKVPOOL1"
_HEADER_BYTES = 4096
_H_MAGIC, _H_NUM_PAGES, _H_NUM_SLOTS, _H_CTX, _H_OWNERS, _H_FREE_TOP, _H_DIRTY, \
    _H_SPEC_LEN, _H_RECLAIMED, _H_FAILED, _H_TP, _H_SETS = range(12)
_SPEC_OFFSET = 256

FREE, RESERVED, READY, FAILED = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", RESERVED: "reserved", READY: "ready", FAILED: "failed"}

# why a reservation failed
OK, TIMEOUT, SENDER_ERROR, UNCLAIMED, OWNER_DIED, CANCELLED = range(6)
FAILURE_REASONS = {
    OK: "ok",
    TIMEOUT: "no KV arrived within the transfer timeout (prefill died, stalled or unreachable)",
    SENDER_ERROR: "a transfer operation failed (the prefill process died mid-transfer)",
    UNCLAIMED: "the decoder did not claim the transferred KV within its lease",
    OWNER_DIED: "the process holding the reservation died",
    CANCELLED: "the reservation was cancelled",
}
# short names, for metric labels and logs
FAILURE_CODES = {OK: "ok", TIMEOUT: "timeout", SENDER_ERROR: "sender_error",
                 UNCLAIMED: "unclaimed", OWNER_DIED: "owner_died", CANCELLED: "cancelled"}


class PoolError(RuntimeError):
    pass


class OutOfPages(PoolError):
    """Not enough free pages (or slots); nothing was allocated."""


class ReservationGone(PoolError):
    """The (slot, generation) names a reservation that no longer exists."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Everything that sizes a shared pool; ``name`` keys its files (model name,
    version and instance, so two versions of a model never share a pool)."""
    name: str
    models: tuple[ModelSpec, ...]
    num_pages: int
    scheme: ShardScheme = ShardScheme(1)
    num_slots: int = 256
    context_bytes: int = 0
    max_owners: int = 64

    def __post_init__(self):
        if "/" in self.name or not self.name:
            raise ValueError(f"pool name {self.name!r} must be a non-empty file name")
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots={self.num_slots}; allowed: 1..{MAX_SLOTS}")
        if self.num_pages < 1 or self.context_bytes < 0 or self.max_owners < 1:
            raise ValueError("num_pages and max_owners must be >= 1, context_bytes >= 0")
        if len({m.page_size for m in self.models}) != 1:
            raise ValueError("all models of a pool share one page_size")

    def kv_bytes(self, model: ModelSpec) -> int:
        return model.pool_bytes(self.scheme.heads_per_rank(model.num_kv_heads), self.num_pages)


@dataclass(frozen=True, slots=True)
class SlotStatus:
    state: int
    generation: int
    completed: int
    expected: int
    error: int

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    @property
    def reason(self) -> str:
        return FAILURE_REASONS.get(self.error, f"error {self.error}")

    @property
    def reason_code(self) -> str:
        return FAILURE_CODES.get(self.error, f"error_{self.error}")


@dataclass(frozen=True, slots=True)
class PoolStats:
    free: int
    reserved: int      # pages of live reservations (not yet claimed)
    in_use: int        # pages owned by processes outside reservations (claimed / allocated)
    slots_active: int
    reclaimed_owners: int
    failed_reservations: int


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks (None if it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[19])   # field 22 of stat, counted after "pid (comm)"


class _Layout:
    """Byte offsets of the arrays in the control file."""

    def __init__(self, num_pages: int, num_slots: int, context_bytes: int, max_owners: int):
        off = _HEADER_BYTES
        self.arrays = {}

        def add(name, dtype, n):
            nonlocal off
            self.arrays[name] = (off, np.dtype(dtype), n)
            off += -(-np.dtype(dtype).itemsize * n // 64) * 64
        add("free_stack", np.int32, num_pages)
        add("page_owner", np.int32, num_pages)
        add("page_slot", np.int32, num_pages)
        add("page_seq", np.int32, num_pages)     # a reserved page's place in its sequence
        add("owner_pid", np.int64, max_owners)
        add("owner_start", np.int64, max_owners)
        for name, dt in (("slot_state", np.uint32), ("slot_error", np.uint32),
                         ("slot_gen", np.uint32), ("slot_owner", np.int32),
                         ("slot_deadline", np.float64), ("slot_expected", np.uint64),
                         ("slot_counter", np.uint64), ("slot_pages", np.uint32)):
            add(name, dt, num_slots)
        add("context", np.uint8, num_slots * context_bytes)
        self.nbytes = off


def _map(path: str, nbytes: int, create: bool):
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)   # tmpfs pages exist now, not at first write
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


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
        self.spec, self.fail_grace_s = spec, fail_grace_s
        self._tlock = threading.RLock()
        self._closed = False
        layout = _Layout(spec.num_pages, spec.num_slots, spec.context_bytes, spec.max_owners)
        self._fd, self._mm = _map(self._ctl_path(spec.name), layout.nbytes, create)
        self._hdr = np.ndarray(32, np.int64, buffer=self._mm)
        for name, (off, dt, n) in layout.arrays.items():
            setattr(self, "_" + name, np.ndarray(n, dt, buffer=self._mm, offset=off))
        self._slot_ctx = self._context.reshape(spec.num_slots, spec.context_bytes)
        if create:
            self._init_control()
        self._kv_files, self._kv = [], {}
        for rank in range(spec.scheme.tp_size):
            for m in spec.models:
                fd, mm = _map(self._kv_path(spec.name, rank, m.name), spec.kv_bytes(m), create)
                self._kv_files.append((fd, mm))
                arr = np.ndarray(spec.kv_bytes(m), np.uint8, buffer=mm)
                if create:
                    arr[::4096] = 0   # pre-fault: first-touch faults cut throughput 6-9x
                self._kv[rank, m.name] = arr
        if create:
            self._hdr[_H_MAGIC] = _MAGIC   # last: openers wait for a complete pool
        self._me = self._register()

    # -- construction --------------------------------------------------------------------
    @staticmethod
    def _ctl_path(name: str) -> str:
        return os.path.join(SHM_DIR, f"{name}.ctl")

    @staticmethod
    def _kv_path(name: str, rank: int, model: str) -> str:
        return os.path.join(SHM_DIR, f"{name}.r{rank}.{model}")

    @classmethod
    def create(cls, spec: PoolSpec, fail_grace_s: float = 30.0) -> "SharedKVPool":
        """Create the pool's files (fails if they exist: see :meth:`unlink_stale`)."""
        return cls(spec, create=True, fail_grace_s=fail_grace_s)

    @classmethod
    def open(cls, name: str, timeout_s: float = 10.0, fail_grace_s: float = 30.0) -> "SharedKVPool":
        """Map a pool another process created (waits for it to be initialised)."""
        path, deadline = cls._ctl_path(name), time.monotonic() + timeout_s
        while True:
            try:
                with open(path, "rb") as f:
                    head = f.read(_HEADER_BYTES)
                hdr = np.frombuffer(head, np.int64, 32) if len(head) == _HEADER_BYTES else None
                if hdr is not None and hdr[_H_MAGIC] == _MAGIC:
                    break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise PoolError(f"shared KV pool {name!r} not found or not initialised at {path}")
            time.sleep(0.01)
        spec_bytes = head[_SPEC_OFFSET:_SPEC_OFFSET + int(hdr[_H_SPEC_LEN])]
        spec = PoolSpec(name, decode_models(Reader(spec_bytes)), int(hdr[_H_NUM_PAGES]),
                        ShardScheme(int(hdr[_H_TP]), int(hdr[_H_SETS])), int(hdr[_H_NUM_SLOTS]),
                        int(hdr[_H_CTX]), int(hdr[_H_OWNERS]))
        return cls(spec, create=False, fail_grace_s=fail_grace_s)

    @classmethod
    def unlink_stale(cls, name: str) -> None:
        """Remove a pool's files (e.g. left by a crashed run with the same name)."""
        for f in os.listdir(SHM_DIR):
            if f == f"{name}.ctl" or (f.startswith(f"{name}.r") and "." in f[len(name) + 2:]):
                try:
                    os.unlink(os.path.join(SHM_DIR, f))
                except FileNotFoundError:
                    pass

    def _init_control(self) -> None:
        spec = self.spec
        models = encode_models(spec.models)
        if _SPEC_OFFSET + len(models) > _HEADER_BYTES:
            raise ValueError("too many models for the pool header")
        self._mm[_SPEC_OFFSET:_SPEC_OFFSET + len(models)] = models
        h = self._hdr
        h[_H_NUM_PAGES], h[_H_NUM_SLOTS] = spec.num_pages, spec.num_slots
        h[_H_CTX] = spec.context_bytes
        h[_H_OWNERS], h[_H_SPEC_LEN] = spec.max_owners, len(models)
        h[_H_TP], h[_H_SETS] = spec.scheme.tp_size, spec.scheme.replica_sets
        self._page_owner[:] = 0
        self._page_slot[:] = -1
        self._slot_state[:] = FREE
        self._rebuild_free_stack()

    def _register(self) -> int:
        with self._locked():
            self._reclaim_dead_locked()
            empty = np.flatnonzero(self._owner_pid == 0)
            if not len(empty):
                raise PoolError(f"more than {self.spec.max_owners} processes attached to "
                                f"pool {self.spec.name!r}")
            i = int(empty[0])
            pid = os.getpid()
            self._owner_start[i] = _proc_start(pid) or 0
            self._owner_pid[i] = pid
            return i + 1   # 0 means "no owner" in the page/slot arrays

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
                    self._owner_pid[self._me - 1] = 0
                if unlink_if_last:
                    self._reclaim_dead_locked()
                    if not np.flatnonzero(self._owner_pid).size:
                        self.unlink()
                        unlinked = True
        self._closed = True
        for name in list(self.__dict__):
            if isinstance(getattr(self, name), np.ndarray):
                setattr(self, name, None)
        self._kv = {}
        for fd, mm in self._kv_files + [(self._fd, self._mm)]:
            try:
                mm.close()
            except BufferError:
                pass   # a caller still holds a view; the mapping goes with the process
            os.close(fd)
        return unlinked

    def unlink(self) -> None:
        self.unlink_stale(self.spec.name)

    # -- memory --------------------------------------------------------------------------
    def kv(self, rank: int, model: str) -> np.ndarray:
        """Flat bytes of one decode rank's KV pool of one model."""
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

    def kv_page_pool(self, rank: int, model: str):
        """A :class:`tandem.backends.kv_cache.KVPagePool` over this shared memory."""
        import torch

        from tandem.backends.kv_cache import KVPagePool
        m = self.model(model)
        return KVPagePool(m.num_layers, self.spec.num_pages,
                          self.spec.scheme.heads_per_rank(m.num_kv_heads), m.page_size,
                          m.head_dim, getattr(torch, m.dtype), m.kv_layout,
                          buffer=torch.frombuffer(self.kv(rank, model), dtype=torch.uint8))

    def context(self, slot: int) -> np.ndarray:
        return self._slot_ctx[slot]

    # -- locking and recovery ------------------------------------------------------------
    @contextmanager
    def _locked(self):
        if self._closed:
            raise PoolError("pool is closed")
        with self._tlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if self._hdr[_H_DIRTY]:
                    self._rebuild_free_stack()   # its last writer died mid-change
                self._hdr[_H_DIRTY] = 1
                try:
                    yield
                finally:
                    # errors raised in-process come before any change; only a death
                    # mid-change leaves the flag set
                    self._hdr[_H_DIRTY] = 0
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _rebuild_free_stack(self) -> None:
        free = np.flatnonzero(self._page_owner == 0).astype(np.int32)
        self._page_slot[free] = -1
        self._free_stack[:len(free)] = free[::-1]   # pop order: lowest ids first
        self._hdr[_H_FREE_TOP] = len(free)

    def _alloc_locked(self, n: int, owner: int, slot: int) -> list[int]:
        top = int(self._hdr[_H_FREE_TOP])
        if n > top:
            raise OutOfPages(f"need {n} pages, {top} free of {self.spec.num_pages}")
        pages = self._free_stack[top - n:top][::-1].copy()
        self._page_owner[pages] = owner
        self._page_slot[pages] = slot
        self._page_seq[pages] = np.arange(n, dtype=np.int32)
        self._hdr[_H_FREE_TOP] = top - n
        return pages.tolist()

    def _free_locked(self, pages) -> None:
        pages = np.asarray(pages, dtype=np.int32)
        if not len(pages):
            return
        top = int(self._hdr[_H_FREE_TOP])
        self._page_owner[pages] = 0
        self._page_slot[pages] = -1
        self._free_stack[top:top + len(pages)] = pages[::-1]
        self._hdr[_H_FREE_TOP] = top + len(pages)

    def _fail_locked(self, slot: int, reason: int) -> None:
        self._free_locked(np.flatnonzero(self._page_slot == slot))
        self._slot_state[slot] = FAILED
        self._slot_error[slot] = reason
        self._slot_deadline[slot] = time.monotonic() + self.fail_grace_s
        self._hdr[_H_FAILED] += 1

    def _release_owner_locked(self, owner: int, reason: int) -> None:
        live = np.flatnonzero((self._slot_owner == owner)
                              & ((self._slot_state == RESERVED) | (self._slot_state == READY)))
        for slot in live:
            self._fail_locked(int(slot), reason)
        self._free_locked(np.flatnonzero(self._page_owner == owner))
        self._owner_pid[owner - 1] = 0

    def _reclaim_dead_locked(self) -> int:
        dead = 0
        for i in np.flatnonzero(self._owner_pid):
            pid = int(self._owner_pid[i])
            if _proc_start(pid) != int(self._owner_start[i]):
                self._release_owner_locked(int(i) + 1, OWNER_DIED)
                self._hdr[_H_RECLAIMED] += 1
                dead += 1
        return dead

    def reclaim_dead(self) -> int:
        """Return the pages and fail the reservations of owners whose process died."""
        with self._locked():
            return self._reclaim_dead_locked()

    def expire(self, now: float | None = None) -> None:
        """Lease housekeeping: unclaimed READY slots fail, FAILED slots become FREE."""
        with self._locked():
            self._expire_locked(time.monotonic() if now is None else now)

    def _expire_locked(self, now: float) -> None:
        self._slot_state[(self._slot_deadline < now) & (self._slot_state == FAILED)] = FREE
        for slot in np.flatnonzero((self._slot_deadline < now) & (self._slot_state == READY)):
            self._fail_locked(int(slot), UNCLAIMED)

    # -- reservations (kv_transfer) ------------------------------------------------------
    def reserve(self, num_pages: int, expected_ops: int,
                timeout_s: float) -> tuple[int, int, list[int]]:
        """Reserve a slot and ``num_pages`` un-evictable pages: (slot, generation, pages)."""
        with self._locked():
            free_slots = np.flatnonzero(self._slot_state == FREE)
            if not len(free_slots) or num_pages > self._hdr[_H_FREE_TOP]:
                self._reclaim_dead_locked()
                self._expire_locked(time.monotonic())
                free_slots = np.flatnonzero(self._slot_state == FREE)
            if not len(free_slots):
                raise OutOfPages(f"all {self.spec.num_slots} reservation slots are in use")
            slot = int(free_slots[0])
            pages = self._alloc_locked(num_pages, self._me, slot)
            gen = (int(self._slot_gen[slot]) + 1) & 0xFFFFFFFF or 1
            self._slot_gen[slot] = gen
            self._slot_owner[slot] = self._me
            self._slot_expected[slot] = expected_ops
            self._slot_counter[slot] = 0
            self._slot_error[slot] = OK
            self._slot_pages[slot] = num_pages
            self._slot_deadline[slot] = time.monotonic() + timeout_s
            self._slot_state[slot] = RESERVED
            return slot, gen, pages

    def arm(self, slot: int, generation: int, expected_ops: int) -> None:
        """Set the number of operations a RESERVED slot's counter expects."""
        with self._locked():
            if self._slot_gen[slot] != generation or self._slot_state[slot] != RESERVED:
                raise ReservationGone(f"reservation {slot}/{generation} is not live")
            self._slot_expected[slot] = expected_ops

    def add_completed(self, slot: int, n: int = 1) -> int:
        """Advance a RESERVED slot's counter (its receiver is the only writer)."""
        c = int(self._slot_counter[slot]) + n
        self._slot_counter[slot] = c
        return c

    def mark_ready(self, slot: int, generation: int, claim_lease_s: float) -> bool:
        with self._locked():
            if self._slot_gen[slot] != generation or self._slot_state[slot] != RESERVED:
                return False
            self._slot_deadline[slot] = time.monotonic() + claim_lease_s
            self._slot_state[slot] = READY
            return True

    def fail(self, slot: int, generation: int, reason: int) -> bool:
        """Fail a live reservation and free its pages. The caller guarantees that no
        receive into them is still in flight."""
        with self._locked():
            if (self._slot_gen[slot] != generation
                    or self._slot_state[slot] not in (RESERVED, READY)):
                return False
            self._fail_locked(slot, reason)
            return True

    # -- the decoder's side --------------------------------------------------------------
    def poll(self, slot: int, generation: int) -> SlotStatus:
        """Lock-free read of a reservation; a reused slot reads as FAILED(CANCELLED)."""
        state, gen = int(self._slot_state[slot]), int(self._slot_gen[slot])
        if gen != generation:
            return SlotStatus(FAILED, generation, 0, 0, CANCELLED)
        error = int(self._slot_error[slot])
        if state == FREE and error != OK:
            state = FAILED   # failed, and its grace period is over
        return SlotStatus(state, gen, int(self._slot_counter[slot]),
                          int(self._slot_expected[slot]), error)

    def claim(self, slot: int, generation: int) -> list[int]:
        """Take over a READY reservation's pages (they become this process's pages)."""
        with self._locked():
            state = int(self._slot_state[slot])
            if self._slot_gen[slot] != generation:
                raise ReservationGone(f"reservation {slot}/{generation} no longer exists "
                                      f"(slot now at generation {int(self._slot_gen[slot])})")
            if state == FREE and self._slot_error[slot] == OK:
                raise ReservationGone(f"reservation {slot}/{generation} was already claimed")
            if state in (FAILED, FREE):
                raise ReservationGone(f"KV transfer for reservation {slot}/{generation} failed: "
                                      f"{FAILURE_REASONS[int(self._slot_error[slot])]}")
            if state != READY:
                raise PoolError(f"reservation {slot}/{generation} is {STATE_NAMES[state]}, "
                                "not ready")
            pages = np.flatnonzero(self._page_slot == slot)
            # in the order reserve() handed them out: the sender wrote the sequence's
            # page j into the descriptor's j-th page, whatever its id
            pages = pages[np.argsort(self._page_seq[pages], kind="stable")]
            self._page_owner[pages] = self._me
            self._page_slot[pages] = -1
            self._slot_state[slot] = FREE
            return pages.tolist()

    def alloc(self, n: int) -> list[int]:
        """Pages for this process outside any reservation (e.g. decode growth)."""
        with self._locked():
            return self._alloc_locked(n, self._me, -1)

    def free(self, pages) -> None:
        pages = np.asarray(list(pages), dtype=np.int64)
        with self._locked():
            if len(pages) and (pages.min() < 0 or pages.max() >= self.spec.num_pages):
                raise ValueError(f"page ids out of range 0..{self.spec.num_pages - 1}")
            wrong = pages[(self._page_owner[pages] != self._me) | (self._page_slot[pages] != -1)]
            if len(wrong) or len(np.unique(pages)) != len(pages):
                raise ValueError(f"pages {wrong.tolist()[:8]} are not this process's to free "
                                 "(double free, or still part of a reservation?)")
            self._free_locked(pages)

    @property
    def num_free(self) -> int:
        return int(self._hdr[_H_FREE_TOP])

    def stats(self) -> PoolStats:
        with self._locked():
            free = int(self._hdr[_H_FREE_TOP])
            reserved = int((self._page_slot >= 0).sum())
            active = int(((self._slot_state == RESERVED) | (self._slot_state == READY)).sum())
            return PoolStats(free, reserved, self.spec.num_pages - free - reserved, active,
                             int(self._hdr[_H_RECLAIMED]), int(self._hdr[_H_FAILED]))


class SharedPageAllocator:
    """The engine's :class:`~tandem.backends.kv_cache.PageAllocator` interface over a
    shared pool, for the decode process: its own allocations plus claimed reservations.

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

    def alloc(self, n: int, pinned: bool = False) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        try:
            return self.pool.alloc(n)
        except OutOfPages as e:
            from tandem.backends.kv_cache import OutOfPages as EngineOutOfPages
            raise EngineOutOfPages(str(e)) from None

    def free(self, pages: list[int]) -> None:
        self.pool.free(pages)
