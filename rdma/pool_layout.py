"""The shared decode pool's files: their names, sizes and layout, and their mapping.

Files under ``/dev/shm``:

- ``{name}.ctl``, the control file: a 4 KiB header of int64 fields (indexed by the
  ``H_*`` constants; the encoded model specs at ``SPEC_OFFSET``), then the per-page,
  per-owner and per-slot arrays of :class:`ControlBlock`, each 64-byte aligned. The
  header names the server the pool belongs to (pid, start time, PID namespace), so a
  file left by a dead server is told from one a live server uses (:func:`pool_owner`);
- ``{name}.r{rank}.{model}``: one decode rank's KV pool of one model, laid out as the
  engine lays out its own pool (``[layers, pages, *page_shape]``), so the engine can
  use it as its buffer.

The creator writes the header's magic last; :func:`read_spec` waits for it, so an
opener never maps a half-initialised pool.

>>> from tandem.rdma.plan import ModelSpec
>>> spec = PoolSpec("doc-layout", (ModelSpec("t", 2, 2, 8, 4, "float32"),), num_pages=8)
>>> ctl = ControlBlock(spec, create=True); ctl.publish()
>>> read_spec("doc-layout") == spec
True
>>> ctl.close(); unlink_files("doc-layout")
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from enum import Enum

import numpy as np

from .errors import PoolError
from .plan import ModelSpec, ShardScheme
from .pool_keys import key_table_size
from .wire import MAX_SLOTS, SECRET_BYTES, Reader, decode_models, encode_models

SHM_DIR = "/dev/shm"
MAGIC = 0x314C4F4F50564B54   # "TKVPOOL1"
HEADER_BYTES = 4096
HEADER_FIELDS = 32
SPEC_OFFSET = 256            # header bytes from here on hold the encoded model specs
H_MAGIC, H_NUM_PAGES, H_NUM_SLOTS, H_CTX, H_OWNERS, H_FREE_TOP, H_DIRTY, \
    H_SPEC_LEN, H_RECLAIMED, H_FAILED, H_TP, H_SETS, H_HEADROOM, H_SERVER_PID, \
    H_SERVER_START, H_PIDNS, H_CREATOR_PID, H_CREATOR_START, H_CANCELLED, \
    H_MAX_PINS, H_EVICTABLE, H_CLOCK, H_CACHE_OWNER, H_EVICTIONS, H_ROOT0, H_ROOT1 = range(26)


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
    # pages reservations may not take: what running sequences need to keep decoding
    # (the decoder's own allocations may use them)
    headroom_pages: int = 0
    # cached pages one reservation may share (the prefix cache, pool_cache.py): the most
    # pages of a prompt; 0 turns the pool's prefix cache off
    max_pins: int = 0

    def __post_init__(self):
        if "/" in self.name or not self.name:
            raise ValueError(f"pool name {self.name!r} must be a non-empty file name")
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots={self.num_slots}; allowed: 1..{MAX_SLOTS}")
        if self.num_pages < 1 or self.context_bytes < 0 or self.max_owners < 1:
            raise ValueError("num_pages and max_owners must be >= 1, context_bytes >= 0")
        if not 0 <= self.headroom_pages < self.num_pages:
            raise ValueError(f"headroom_pages={self.headroom_pages}; allowed: 0..{self.num_pages - 1}")
        if len({m.page_size for m in self.models}) != 1:
            raise ValueError("all models of a pool share one page_size")
        if not 0 <= self.max_pins <= self.num_pages:
            raise ValueError(f"max_pins={self.max_pins}; allowed: 0..{self.num_pages}")

    def kv_bytes(self, model: ModelSpec) -> int:
        return model.pool_bytes(model.heads_per_rank(self.scheme), self.num_pages)


# -- file names ----------------------------------------------------------------------------
def ctl_path(name: str) -> str:
    return os.path.join(SHM_DIR, f"{name}.ctl")


def kv_path(name: str, rank: int, model: str) -> str:
    return os.path.join(SHM_DIR, f"{name}.r{rank}.{model}")


def unlink_files(name: str) -> None:
    """Remove a pool's files, whichever exist."""
    for f in os.listdir(SHM_DIR):
        if f == f"{name}.ctl" or (f.startswith(f"{name}.r") and "." in f[len(name) + 2:]):
            try:
                os.unlink(os.path.join(SHM_DIR, f))
            except FileNotFoundError:
                pass


def map_file(path: str, nbytes: int, create: bool) -> tuple[int, mmap.mmap]:
    """Map a shared file (created with ``create``, which fails if it exists)."""
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


def _close_map(fd: int, mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass   # a caller still holds a view; the mapping goes with the process
    os.close(fd)


def read_spec(name: str, timeout_s: float = 10.0) -> PoolSpec:
    """The spec of a pool another process created (waits for it to be initialised)."""
    path, deadline = ctl_path(name), time.monotonic() + timeout_s
    while True:
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
            hdr = np.frombuffer(head, np.int64, HEADER_FIELDS) if len(head) == HEADER_BYTES else None
            if hdr is not None and hdr[H_MAGIC] == MAGIC:
                break
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise PoolError(f"shared KV pool {name!r} not found or not initialised at {path}")
        time.sleep(0.01)
    spec_bytes = head[SPEC_OFFSET:SPEC_OFFSET + int(hdr[H_SPEC_LEN])]
    return PoolSpec(name, decode_models(Reader(spec_bytes)), int(hdr[H_NUM_PAGES]),
                    ShardScheme(int(hdr[H_TP]), int(hdr[H_SETS])), int(hdr[H_NUM_SLOTS]),
                    int(hdr[H_CTX]), int(hdr[H_OWNERS]), int(hdr[H_HEADROOM]),
                    int(hdr[H_MAX_PINS]))


# -- whose pool is it ----------------------------------------------------------------------
def proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks (None if it does not exist, or is dead
    and not yet reaped: a SIGKILLed stub stays a zombie until its server waits for it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])   # field 22 of stat, counted after "pid (comm)"


def pid_namespace() -> int:
    """This process's PID namespace (processes in other namespaces cannot be checked)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def alive(pid: int, start: int) -> bool:
    return pid > 0 and proc_start(pid) == start


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PoolOwner(Enum):
    """What :func:`pool_owner` found at a pool's name."""
    MISSING = "missing"          # no control file
    STARTING = "starting"        # its creator is still writing the header
    OURS = "ours"                # created for this server: attach
    STALE = "stale"              # its server (or its half-done creator) is dead: replace
    OTHER = "other"              # a live server's, or one we cannot check: refuse


def pool_owner(name: str, server_pid: int) -> tuple[PoolOwner, str]:
    """Whose pool file ``name`` is, seen from a process of the server ``server_pid``:
    (verdict, why)."""
    try:
        with open(ctl_path(name), "rb") as f:
            head = f.read(HEADER_BYTES)
    except FileNotFoundError:
        return PoolOwner.MISSING, "no pool file"
    if len(head) < HEADER_BYTES:
        return PoolOwner.STARTING, "header not written yet"
    hdr = np.frombuffer(head, np.int64, HEADER_FIELDS)
    if not hdr[H_CREATOR_PID]:
        return PoolOwner.STARTING, "header not written yet"
    if hdr[H_PIDNS] and hdr[H_PIDNS] != pid_namespace():
        return PoolOwner.OTHER, ("it was created in another PID namespace (another container "
                                 "sharing /dev/shm?), whose processes cannot be checked")
    server, start = int(hdr[H_SERVER_PID]), int(hdr[H_SERVER_START])
    if server == server_pid and start == proc_start(server_pid):
        if hdr[H_MAGIC] == MAGIC or alive(int(hdr[H_CREATOR_PID]), int(hdr[H_CREATOR_START])):
            return PoolOwner.OURS, "this server's"
        return PoolOwner.STALE, "its creator died before it was initialised"
    if alive(server, start):
        return PoolOwner.OTHER, f"it belongs to another live server (pid {server})"
    return PoolOwner.STALE, f"its server (pid {server}) is gone"


# -- the control file ----------------------------------------------------------------------
def _arrays(spec: PoolSpec) -> list[tuple[str, np.dtype, int]]:
    """The control file's arrays after the header, in file order: (name, dtype, length)."""
    pages, owners, slots = spec.num_pages, spec.max_owners, spec.num_slots
    return [
        ("free_stack", np.int32, pages),
        ("page_owner", np.int32, pages),
        ("page_slot", np.int32, pages),
        ("page_seq", np.int32, pages),      # a reserved page's place in its sequence
        ("owner_pid", np.int64, owners),
        ("owner_start", np.int64, owners),
        ("slot_state", np.uint32, slots),
        ("slot_error", np.uint32, slots),
        ("slot_gen", np.uint32, slots),
        ("slot_owner", np.int32, slots),
        ("slot_deadline", np.float64, slots),
        ("slot_expected", np.uint64, slots),
        ("slot_counter", np.uint64, slots),
        ("slot_pages", np.uint32, slots),
        ("slot_cancel", np.uint32, slots),  # generation the decoder asked to cancel
        ("slot_secret", np.uint8, slots * SECRET_BYTES),
        ("context", np.uint8, slots * spec.context_bytes),
        # the prefix cache (pool_cache.py): a published page's key, whether the cache's
        # owner (decode) holds it, how many reservations share it, when it was last freed;
        # the key -> page hash table of the cached pages (pool_keys.py)
        ("page_key", np.uint64, 2 * pages),
        ("page_cached", np.uint8, pages),
        ("page_held", np.uint8, pages),
        ("page_pins", np.int32, pages),
        ("page_stamp", np.int64, pages),
        ("slot_num_pins", np.uint32, slots),
        ("slot_pins", np.int32, slots * spec.max_pins),
        ("key_table", np.int32, key_table_size(pages)),
    ]


class ControlBlock:
    """The control file, mapped: ``hdr`` (the header's int64 fields) and one numpy view
    per array of :func:`_arrays` (``page_owner``, ``slot_state``, ...), plus
    ``slot_ctx``, the context buffers as ``[num_slots, context_bytes]``.

    It holds no policy: the pool's components read and write these arrays under the
    pool's lock (the ``fd`` that the lock is taken on).
    """

    def __init__(self, spec: PoolSpec, create: bool):
        arrays, offsets, off = _arrays(spec), [], HEADER_BYTES
        for _, dtype, n in arrays:
            offsets.append(off)
            off += -(-np.dtype(dtype).itemsize * n // 64) * 64
        self.fd, self.mm = map_file(ctl_path(spec.name), off, create)
        self.hdr = np.ndarray(HEADER_FIELDS, np.int64, buffer=self.mm)
        self._names = [name for name, _, _ in arrays]
        for (name, dtype, n), o in zip(arrays, offsets):
            setattr(self, name, np.ndarray(n, dtype, buffer=self.mm, offset=o))
        self.slot_ctx = self.context.reshape(spec.num_slots, spec.context_bytes)
        self.secrets = self.slot_secret.reshape(spec.num_slots, SECRET_BYTES)
        self.page_keys = self.page_key.reshape(spec.num_pages, 2)
        self.pins = self.slot_pins.reshape(spec.num_slots, spec.max_pins)
        if create:
            self._write_header(spec)

    def _write_header(self, spec: PoolSpec) -> None:
        models = encode_models(spec.models)
        if SPEC_OFFSET + len(models) > HEADER_BYTES:
            raise ValueError("too many models for the pool header")
        self.mm[SPEC_OFFSET:SPEC_OFFSET + len(models)] = models
        h = self.hdr
        h[H_NUM_PAGES], h[H_NUM_SLOTS] = spec.num_pages, spec.num_slots
        h[H_CTX] = spec.context_bytes
        h[H_OWNERS], h[H_SPEC_LEN] = spec.max_owners, len(models)
        h[H_TP], h[H_SETS] = spec.scheme.tp_size, spec.scheme.replica_sets
        h[H_HEADROOM] = spec.headroom_pages
        h[H_MAX_PINS] = spec.max_pins

    def set_server(self, server_pid: int) -> None:
        """Name the server this pool belongs to and its creator (first, before the slow
        part of creation: an opener tells a live creator from a dead one by them)."""
        h, me = self.hdr, os.getpid()
        h[H_SERVER_PID], h[H_SERVER_START] = server_pid, proc_start(server_pid) or 0
        h[H_PIDNS] = pid_namespace()
        h[H_CREATOR_START] = proc_start(me) or 0
        h[H_CREATOR_PID] = me   # last: its being set means the others are

    def publish(self) -> None:
        """Mark the pool initialised (last: openers wait for it)."""
        self.hdr[H_MAGIC] = MAGIC

    def close(self) -> None:
        # drop our own views first, or the mapping cannot close
        for name in self._names + ["hdr", "slot_ctx", "secrets", "page_keys", "pins"]:
            setattr(self, name, None)
        _close_map(self.fd, self.mm)


class KVFiles:
    """Every decode rank's KV pool of every model, mapped: ``kv[rank, model]`` is one
    pool's flat bytes."""

    def __init__(self, spec: PoolSpec, create: bool):
        self._maps, self._kv = [], {}
        for rank in range(spec.scheme.tp_size):
            for m in spec.models:
                if rank >= m.split(spec.scheme).tp_size:
                    continue   # a leader-only model's KV: rank 0's file alone
                fd, mm = map_file(kv_path(spec.name, rank, m.name), spec.kv_bytes(m), create)
                self._maps.append((fd, mm))
                arr = np.ndarray(spec.kv_bytes(m), np.uint8, buffer=mm)
                if create:
                    arr[::4096] = 0   # pre-fault: first-touch faults cut throughput 6-9x
                self._kv[rank, m.name] = arr

    def __getitem__(self, key: tuple[int, str]) -> np.ndarray:
        return self._kv[key]

    def close(self) -> None:
        self._kv = {}
        for fd, mm in self._maps:
            _close_map(fd, mm)
        self._maps = []
