"""A tensor-parallel group of processes on one host: the leader (rank 0, the engine's own
process) starts ranks 1..tp-1, they meet at a TCP store on 127.0.0.1 and sum their
partial outputs over gloo.

Two channels, for two kinds of waiting:

- each step's work goes to a rank over a pipe, which a rank may wait on forever (an idle
  server sends nothing) and which ends when the leader dies, so a rank never outlives it;
- the all-reduces inside a step go over gloo, where every operation gives up after
  ``timeout_s``: a rank that dies mid-step fails the step (gloo also notices a closed
  socket at once) instead of hanging it. A group that failed once is broken for good:
  its ranks may be in different steps, so it is stopped and started anew, never reused.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

READY, FAILED = "ready", "failed"


class RankFailed(RuntimeError):
    """A rank died, failed to start, or a collective timed out: the group is broken."""


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank process needs: its place in the group, where to meet, and the
    caller's ``payload`` (what to build there)."""
    rank: int
    tp: int
    store_port: int
    timeout_s: float
    threads: int
    payload: Any


class Collective:
    """One rank's gloo group: the sum over ranks that the model's row-parallel layers
    call (``all_reduce``), in fp32 whatever the activations' dtype."""

    def __init__(self, store, rank: int, tp: int, timeout_s: float):
        self.rank, self.tp = rank, tp
        self.group = torch.distributed.ProcessGroupGloo(store, rank, tp, timedelta(seconds=timeout_s))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        try:
            self.group.allreduce([buf]).wait()
        except RuntimeError as err:    # a peer closed its socket, or the timeout passed
            raise RankFailed(f"tensor-parallel all-reduce on rank {self.rank} failed: {err}") from err
        return buf if buf is x else buf.to(x.dtype)


def rank_threads(tp: int) -> int:
    """torch threads per rank: the process's own count shared out, at least one each."""
    return max(1, torch.get_num_threads() // tp)


def connect(spec: RankSpec) -> Collective:
    """A started rank joins the leader's store and group."""
    store = torch.distributed.TCPStore("127.0.0.1", spec.store_port, spec.tp, False,
                                       timedelta(seconds=spec.timeout_s))
    return Collective(store, spec.rank, spec.tp, spec.timeout_s)


class RankGroup:
    """The leader's side: rank processes started, pipes to them, its own Collective."""

    def __init__(self, tp: int, timeout_s: float, payload: Any, entry: Callable[[RankSpec, Connection], None],
                 start_timeout_s: float = 600.0):
        """Start ranks 1..tp-1 running ``entry(spec, conn)`` (a module-level function:
        they are spawned, not forked, so torch's threads start clean) and join them;
        returns once the group exists. Call :meth:`wait_ready` after the leader built
        its own share (the ranks build theirs meanwhile)."""
        self.tp, self.timeout_s, self.start_timeout_s = tp, timeout_s, start_timeout_s
        self.threads = rank_threads(tp)
        self.broken: str | None = None
        store = torch.distributed.TCPStore("127.0.0.1", 0, tp, True, timedelta(seconds=timeout_s),
                                           wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        if os.path.basename(sys.executable).startswith("python"):
            ctx.set_executable(sys.executable)
        self.procs, self.conns = [], []
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            spec = RankSpec(rank, tp, store.port, timeout_s, self.threads, payload)
            proc = ctx.Process(target=entry, args=(spec, child), name=f"tandem-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        torch.set_num_threads(self.threads)
        try:   # the ranks join before they load anything: seconds, well within timeout_s
            self.collective = Collective(store, 0, tp, timeout_s)
        except RuntimeError as err:
            self.stop()
            raise RankFailed(f"tensor-parallel ranks did not join: {err}; {self._exits()}") from err
        self.store = store
        self.all_reduce = self.collective.all_reduce

    def wait_ready(self) -> None:
        """Each rank's report that it built its share; raises the first failure."""
        for rank, conn in enumerate(self.conns, 1):
            if not conn.poll(self.start_timeout_s):
                self.stop()
                raise RankFailed(f"tensor-parallel rank {rank} did not start in {self.start_timeout_s:.0f} s")
            try:
                status, detail = conn.recv()
            except EOFError:
                status, detail = FAILED, self._exits()
            if status != READY:
                self.stop()
                raise RankFailed(f"tensor-parallel rank {rank} failed to start: {detail}")

    def send(self, message: Any) -> None:
        """``message`` to every rank (each step's work); raises when the group is broken."""
        self.check()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as err:
                self.fail(f"rank {rank}'s pipe closed ({err}); {self._exits()}")

    def check(self) -> None:
        if self.broken is None and any(not p.is_alive() for p in self.procs):
            self.broken = self._exits()
        if self.broken is not None:
            raise RankFailed(f"the tensor-parallel group is broken: {self.broken}")

    def fail(self, why: str) -> None:
        """Mark the group broken (its ranks may be out of step) and raise."""
        self.broken = self.broken or why
        raise RankFailed(f"the tensor-parallel group is broken: {self.broken}")

    def _exits(self) -> str:
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        return "; ".join(dead) or "every rank process is still running"

    def stop(self) -> None:
        """End the ranks: their pipes close (they exit), then any left are killed."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.broken = self.broken or "stopped"
