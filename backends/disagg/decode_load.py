"""What decode tells kv_transfer about its batch, and what it learns from the pool.

- :class:`DecodeLoadBoard` — a few words in shared memory beside the decode pool
  (``/dev/shm/<pool name>.load``): decode writes its own prefill backlog after every
  step, and how many prompt tokens it has taken in to prefill itself so far;
  kv_transfer reads it for routing (:mod:`.routing`). A hint, read without a lock.
- :class:`InTransit` — kv_transfer's ledger of the prompts it routed local that decode
  has not taken in yet (they pass prefill and the ensemble's hops first): without it a
  burst of short prompts would all see the same backlog and all go local.
- :class:`DecodeStepHook` — runs on the decode engine's thread before and after each
  step: publishes the backlog, and gives the engine the prefill side's core while that
  side has nothing to do (``idle_threads``) and the batch is large enough to gain from
  it (``borrow_min_seqs``), handing it back as soon as a reservation waits for KV. On a
  host where prefill and decode share the cores, a decoder that prefills short prompts
  itself would otherwise leave the idle prefill core unused; with a small batch the
  core serves Triton's own per-response work better (measured on 2 cores: 4 streams
  decoded 186 tok/s each on one thread, 155–159 on two).

>>> board = DecodeLoadBoard("doc-decode-load", create=True)
>>> board.publish(prefill_tokens=300, taken_in=300); board.read()
DecodeLoad(prefill_tokens=300)
>>> board.close(unlink=True)
"""
from __future__ import annotations

import mmap
import os
import time
from collections import deque

import numpy as np

from tandem.rdma.pool_layout import SHM_DIR, pid_exists

from .routing import DecodeLoad

# prefill_tokens, updated (monotonic ns), writer pid, prompt tokens taken in (cumulative),
# (unused: was the prefill side's down word, now kv_transfer's own), sequences in decode's batch
_WORDS = 6


def board_path(pool_name: str) -> str:
    return os.path.join(SHM_DIR, f"{pool_name}.load")


class DecodeLoadBoard:
    """The decode engine's load in shared memory; decode ``create``s it (or takes over
    the one a reloaded decode left), kv_transfer opens it when it exists."""

    def __init__(self, pool_name: str, create: bool = False):
        self.path = board_path(pool_name)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create and os.fstat(fd).st_size < _WORDS * 8:
                os.ftruncate(fd, _WORDS * 8)
            self._mm = mmap.mmap(fd, _WORDS * 8)
        finally:
            os.close(fd)
        self._words = np.frombuffer(self._mm, dtype=np.int64)

    @classmethod
    def open_if_exists(cls, pool_name: str) -> "DecodeLoadBoard | None":
        try:
            return cls(pool_name)
        except (FileNotFoundError, ValueError):   # not yet created, or still empty
            return None

    def publish(self, prefill_tokens: int, taken_in: int = 0, running: int = 0) -> None:
        """``taken_in``: prompt tokens of the local-path sequences this process has
        admitted since it started (cumulative; :class:`InTransit` reads it);
        ``running``: the sequences in decode's batch (the local prefill reads it)."""
        w = self._words
        w[5] = running
        w[3] = taken_in
        w[0] = prefill_tokens
        w[1] = time.monotonic_ns()
        w[2] = os.getpid()

    def read(self) -> DecodeLoad:
        """The last published load; none when its writer is gone (a dead decode's
        backlog died with it)."""
        tokens, _, pid = (int(x) for x in self._words[:3])
        if pid and not pid_exists(pid):
            return DecodeLoad()
        return DecodeLoad(prefill_tokens=max(0, tokens))

    def decode_idle(self) -> bool:
        """Whether decode holds no sequence in its batch (or its writer is gone)."""
        pid = int(self._words[2])
        return int(self._words[5]) == 0 or (pid != 0 and not pid_exists(pid))

    def taken_in(self) -> tuple[int, int]:
        """(writer pid, its cumulative count of prompt tokens taken in)."""
        return int(self._words[2]), int(self._words[3])

    def close(self, unlink: bool = False) -> None:
        self._words = None
        self._mm.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class InTransit:
    """Prompt tokens routed local that decode has not taken in yet, as kv_transfer
    reckons them: its routes in order, matched first-in first-out against decode's
    cumulative count (:meth:`DecodeLoadBoard.taken_in`). A route older than
    ``horizon_s`` is dropped (its request failed or was cancelled on the way); a new
    decode process (another writer pid) starts its count afresh.

    >>> t = InTransit()
    >>> t.observe(writer=7, taken_in=0, now=0.0); t.add(200, now=0.0); t.add(100, now=0.0)
    0
    >>> t.observe(writer=7, taken_in=200, now=0.01)    # decode took the first one in
    100
    """

    def __init__(self, horizon_s: float = 2.0):
        self.horizon_s = horizon_s
        self._routes: deque = deque()      # [routed at, tokens not yet matched]
        self._seen: tuple[int, int] | None = None

    def observe(self, writer: int, taken_in: int, now: float) -> int:
        """Match decode's count read now; the tokens still in transit."""
        seen, self._seen = self._seen, (writer, taken_in)
        arrived = taken_in - seen[1] if seen is not None and seen[0] == writer else 0
        routes = self._routes
        while routes and arrived > 0:
            take = min(arrived, routes[0][1])
            routes[0][1] -= take
            arrived -= take
            if routes[0][1] == 0:
                routes.popleft()
        while routes and routes[0][0] < now - self.horizon_s:
            routes.popleft()
        return sum(r[1] for r in routes)

    def add(self, tokens: int, now: float) -> None:
        """A route to the local path, right after :meth:`observe` (the count it follows)."""
        self._routes.append([now, tokens])


def prefill_backlog_tokens(scheduler) -> int:
    """Prompt tokens the engine still prefills itself (waiting and running sequences)."""
    return sum(max(0, len(s.prompt_ids) - s.num_computed)
               for queue in (scheduler.waiting, scheduler.running) for s in queue)


class DecodeStepHook:
    """Called on the engine thread around every step (``AsyncEngine.step_hook``)."""

    def __init__(self, engine, pool, board: DecodeLoadBoard | None, threads: int,
                 idle_threads: int, borrow_min_seqs: int = 1):
        """``engine``: the :class:`~tandem.backends.engine.async_engine.AsyncEngine`
        (its ``scheduler``'s queues are read);
        ``pool``: the shared decode pool (its RESERVED reservations are the prefill
        side's work); ``threads``: torch threads while the prefill side works;
        ``idle_threads``: while it has nothing to do and the batch holds at least
        ``borrow_min_seqs`` sequences (``idle_threads == threads``: never switch). Size the
        OpenMP team for ``max(threads, idle_threads)`` on the process's main thread
        before the engine starts: raising it from the engine thread made steps ~20x
        slower (measured); lowering and raising it again below that size does not."""
        self.engine, self.pool, self.board = engine, pool, board
        self.threads, self.idle_threads = threads, idle_threads
        self.borrow_min_seqs = borrow_min_seqs
        self._published: tuple[int, int] | None = None
        self._current: int | None = None
        self._taken_in = 0                 # prompt tokens of local-path sequences admitted
        self._known: set[str] = set()      # the request ids among them seen already

    def __call__(self) -> None:
        if self.board is not None:
            scheduler = self.engine.scheduler
            self._count_arrivals(scheduler)
            state = (prefill_backlog_tokens(scheduler), self._taken_in, len(scheduler.running))
            if state != self._published:
                self.board.publish(*state)
                self._published = state
        if self.idle_threads != self.threads:
            batch = len(self.engine.scheduler.running)
            idle = batch >= self.borrow_min_seqs and not self.pool.backlog()[0]
            want = self.idle_threads if idle else self.threads
            if want != self._current:
                import torch
                torch.set_num_threads(want)   # this (the engine's) thread's OpenMP team
                self._current = want

    def _count_arrivals(self, scheduler) -> None:
        """New sequences reach the waiting queue; those with nothing computed came by
        the local path (a transferred one arrives prefilled; a preempted one is known)."""
        live = {s.request_id for queue in (scheduler.waiting, scheduler.running) for s in queue}
        for seq in scheduler.waiting:
            if seq.request_id not in self._known:
                self._known.add(seq.request_id)
                if seq.num_computed == 0:
                    self._taken_in += len(seq.prompt_ids)
        self._known &= live


class PrefillThreads:
    """Runs on the local prefill's engine thread before each step: its torch threads are
    ``idle_threads`` while decode holds no sequence (a cold request at low concurrency
    then prefills on decode's idle cores too), else ``threads``. Size the OpenMP team for
    ``max(threads, idle_threads)`` on the main thread first (as for decode's borrowing).
    Until decode has made its board (``open_board`` returns None) it keeps ``threads``."""

    def __init__(self, pool_name: str, threads: int, idle_threads: int,
                 open_board=DecodeLoadBoard.open_if_exists, set_threads=None):
        self.pool_name, self.threads, self.idle_threads = pool_name, threads, idle_threads
        self._open_board, self._board = open_board, None
        if set_threads is None:
            import torch
            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._current: int | None = None

    def __call__(self) -> None:
        if self.idle_threads == self.threads:
            return
        if self._board is None:
            self._board = self._open_board(self.pool_name)
        want = self.idle_threads if self._board is not None and self._board.decode_idle() else self.threads
        if want != self._current:
            self._set_threads(want)
            self._current = want
