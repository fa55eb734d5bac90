"""A tensor-parallel group of processes on one host: the leader (rank 0, the engine's own
process) starts ranks 1..tp-1, they meet at a TCP store on 127.0.0.1 and sum their
partial outputs over gloo.

Two channels, for two kinds of waiting:

- each step's work goes to a rank over a pipe, which a rank may wait on forever (an idle
  server sends nothing) and which ends when the leader dies, so a rank never outlives it;
- the all-reduces inside a step go through a shared memory segment
  (backends/cpu_kernels/shm_all_reduce.cpp: microseconds, where gloo's TCP path took
  1.1-1.7 ms a call here), or over gloo where the kernels are off or a tensor is larger
  than the segment's buffers. Either way every operation gives up after ``timeout_s``,
  and a peer that died fails it at once (the kernel checks the peers' processes, gloo
  sees the socket close): a rank that dies mid-step fails the step instead of hanging
  it. A group that failed once is broken for good: its ranks may be in different steps,
  so it is stopped and started anew, never reused.

The segment (``/dev/shm/tandem-tp-<pid>-<token>``) is unlinked as soon as every rank has
mapped it, so a crash leaves no file behind.
"""
from __future__ import annotations

import mmap
import multiprocessing
import os
import secrets
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from .. import cpu_kernels

READY, FAILED = "ready", "failed"
SHM_DIR = "/dev/shm"
SHM_CAPACITY = 4 << 20      # bytes per rank and bank: 1,800 rows of a 576-wide model in fp32


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
    shm_path: str | None = None     # the all-reduce segment (None: gloo only)


class Collective:
    """One rank's all-reduce (``all_reduce``, which the model's row-parallel layers call):
    the sum over ranks in fp32 whatever the activations' dtype, through the shared
    segment when there is one, else over gloo."""

    def __init__(self, store, rank: int, tp: int, timeout_s: float, shm_path: str | None = None):
        self.rank, self.tp, self.timeout_s = rank, tp, timeout_s
        self.shm, self.seq = None, 0
        if shm_path is not None:
            with open(shm_path, "r+b") as f:
                self._mapping = mmap.mmap(f.fileno(), 0)
            self.shm = torch.frombuffer(self._mapping, dtype=torch.uint8)
        store.set(f"pid{rank}", str(os.getpid()))
        self.group = torch.distributed.ProcessGroupGloo(store, rank, tp, timedelta(seconds=timeout_s))
        self.pids = torch.tensor([int(store.get(f"pid{r}")) for r in range(tp)], dtype=torch.int64)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        try:
            if self.shm is not None and 4 * buf.numel() <= SHM_CAPACITY:
                self.seq += 1
                torch.ops.tandem_cpu.shm_all_reduce_(buf, self.shm, self.rank, self.tp, self.seq, SHM_CAPACITY,
                                                     self.pids, self.timeout_s)
            else:
                self.group.allreduce([buf]).wait()
        except RuntimeError as err:    # a peer died or closed its socket, or the timeout passed
            raise RankFailed(f"tensor-parallel all-reduce on rank {self.rank} failed: {err}") from err
        return buf if buf is x else buf.to(x.dtype)


def make_segment(tp: int) -> str | None:
    """A zeroed all-reduce segment for ``tp`` ranks (None: the kernels are off here)."""
    if not cpu_kernels.load("all_reduce") or not os.path.isdir(SHM_DIR):
        return None
    path = os.path.join(SHM_DIR, f"tandem-tp-{os.getpid()}-{secrets.token_hex(4)}")
    with open(path, "wb") as f:
        f.truncate(tp * 64 + 2 * tp * SHM_CAPACITY)
    return path


def rank_threads(tp: int) -> int:
    """torch threads per rank: the process's own count shared out, at least one each."""
    return max(1, torch.get_num_threads() // tp)


def connect(spec: RankSpec) -> Collective:
    """A started rank joins the leader's store and group."""
    store = torch.distributed.TCPStore("127.0.0.1", spec.store_port, spec.tp, False,
                                       timedelta(seconds=spec.timeout_s))
    if spec.shm_path is not None:
        cpu_kernels.load("all_reduce")     # the leader built it: loaded from the cache
    return Collective(store, spec.rank, spec.tp, spec.timeout_s, spec.shm_path)


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
        shm_path = make_segment(tp)
        ctx = multiprocessing.get_context("spawn")
        # the ranks run this environment's interpreter (in a Triton stub sys.executable
        # is the stub, not a Python)
        ctx.set_executable(sys.executable if os.path.basename(sys.executable).startswith("python")
                           else os.path.join(sys.prefix, "bin", "python3"))
        self.procs, self.conns = [], []
        try:
            for rank in range(1, tp):
                parent, child = ctx.Pipe()
                spec = RankSpec(rank, tp, store.port, timeout_s, self.threads, payload, shm_path)
                proc = ctx.Process(target=entry, args=(spec, child), name=f"tandem-tp-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            torch.set_num_threads(self.threads)
            # the ranks join before they load anything: seconds, well within timeout_s
            self.collective = Collective(store, 0, tp, timeout_s, shm_path)
        except RuntimeError as err:
            self.stop()
            raise RankFailed(f"tensor-parallel ranks did not join: {err}; {self._exits()}") from err
        except BaseException:
            self.stop()
            raise
        finally:   # every rank mapped it before it joined (or none will): the name is no longer needed
            if shm_path is not None:
                os.unlink(shm_path)
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
