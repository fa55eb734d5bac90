"""What decode tells kv_transfer about its batch, and what it learns from the pool.

- :class:`DecodeLoadBoard` — a few words in shared memory beside the decode pool
  (``/dev/shm/<pool name>.load``): decode writes its own prefill backlog after every
  step, kv_transfer reads it for routing (:mod:`.routing`). A hint, read without a lock.
- :class:`DecodeStepHook` — runs on the decode engine's thread before and after each
  step: publishes the backlog, and gives the engine the prefill side's core while that
  side has nothing to do (``idle_threads``) and the batch is large enough to gain from
  it (``borrow_min_seqs``), handing it back as soon as a reservation waits for KV. On a
  host where prefill and decode share the cores, a decoder that prefills short prompts
  itself would otherwise leave the idle prefill core unused; with a small batch the
  core serves Triton's own per-response work better (measured on 2 cores: 4 streams
  decoded 186 tok/s each on one thread, 155–159 on two).

>>> board = DecodeLoadBoard("doc-decode-load", create=True)
>>> board.publish(prefill_tokens=300); board.read()
DecodeLoad(prefill_tokens=300)
>>> board.close(unlink=True)
"""
from __future__ import annotations

import mmap
import os
import time

import numpy as np

from tandem.rdma.pool_layout import SHM_DIR, pid_exists

from .routing import DecodeLoad

_WORDS = 4   # prefill_tokens, updated (monotonic ns), writer pid, reserved


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

    def publish(self, prefill_tokens: int) -> None:
        w = self._words
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

    def close(self, unlink: bool = False) -> None:
        self._words = None
        self._mm.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def prefill_backlog_tokens(scheduler) -> int:
    """Prompt tokens the engine still prefills itself (waiting and running sequences)."""
    return sum(max(0, len(s.prompt_ids) - s.num_computed)
               for queue in (scheduler.waiting, scheduler.running) for s in queue)


class DecodeStepHook:
    """Called on the engine thread around every step (``AsyncEngine.step_hook``)."""

    def __init__(self, engine, pool, board: DecodeLoadBoard | None, threads: int,
                 idle_threads: int, borrow_min_seqs: int = 1):
        """``engine``: the :class:`~tandem.backends.engine.llm_engine.LLMEngine`;
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
        self._published: int | None = None
        self._current: int | None = None

    def __call__(self) -> None:
        if self.board is not None:
            backlog = prefill_backlog_tokens(self.engine.scheduler)
            if backlog != self._published:
                self.board.publish(backlog)
                self._published = backlog
        if self.idle_threads != self.threads:
            batch = len(self.engine.scheduler.running)
            idle = batch >= self.borrow_min_seqs and not self.pool.backlog()[0]
            want = self.idle_threads if idle else self.threads
            if want != self._current:
                import torch
                torch.set_num_threads(want)   # this (the engine's) thread's OpenMP team
                self._current = want
