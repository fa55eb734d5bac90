"""The KV pools of a tensor-parallel engine's ranks 1..tp-1 in POSIX shared memory,
mapped by the leader too: one process (the leader's, which runs the KV messenger)
reads what every rank computed, as the disaggregation article maps every GPU's KV
memory into the one process that runs the transfer engine.

The leader creates one file per rank (``/dev/shm/tandem-tpkv-<pid>-<token>.r<rank>``)
and maps it; each rank maps its own by name (:class:`RankPoolFiles` is picklable and
travels to the rank as ``RankWork.rank_pool``). Once every rank has mapped its file
the leader unlinks them all (:meth:`RankPoolFiles.unlink`): the memory lives as long as
a mapping does, and a crash leaves no file behind.

>>> files, pools = RankPoolFiles.create(3, num_layers=2, num_pages=4, num_kv_heads=1,
...                                     page_size=4, head_dim=8, dtype="float32", kv_layout="HND")
>>> [p.kv.shape[:2] for p in pools], files.unlink()
([torch.Size([2, 4]), torch.Size([2, 4])], None)
"""
from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

import torch

from ..kv_cache import KVPagePool
from ..parallel.group import SHM_DIR


@dataclass(frozen=True, slots=True)
class RankPoolFiles:
    """Where ranks 1..tp-1 keep their KV pools, and their geometry (each rank's share:
    ``num_kv_heads`` is the heads one rank holds)."""
    prefix: str
    tp: int
    num_layers: int
    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: str
    kv_layout: str

    @classmethod
    def create(cls, tp: int, **geometry) -> tuple["RankPoolFiles", list[KVPagePool]]:
        """The files of ranks 1..tp-1, created zeroed, and the leader's view of each."""
        files = cls(os.path.join(SHM_DIR, f"tandem-tpkv-{os.getpid()}-{secrets.token_hex(4)}"), tp, **geometry)
        pools = []
        try:
            for rank in range(1, tp):
                pools.append(files.map(rank, create=True))
        except BaseException:
            files.unlink()
            raise
        return files, pools

    def path(self, rank: int) -> str:
        return f"{self.prefix}.r{rank}"

    @property
    def nbytes(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.num_pages * self.num_kv_heads * self.page_size * self.head_dim * itemsize

    def map(self, rank: int, create: bool = False) -> KVPagePool:
        if not 1 <= rank < self.tp:
            raise ValueError(f"rank {rank}: the shared pools are those of ranks 1..{self.tp - 1}")
        fd = os.open(self.path(rank), os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:   # tmpfs pages allocated now, not at the first write of a step
                os.posix_fallocate(fd, 0, self.nbytes)
            mapping = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)   # the mapping keeps the memory
        return KVPagePool(self.num_layers, self.num_pages, self.num_kv_heads, self.page_size, self.head_dim,
                          getattr(torch, self.dtype), self.kv_layout,
                          buffer=torch.frombuffer(mapping, dtype=torch.uint8))

    def __call__(self, rank: int) -> KVPagePool:
        """Rank ``rank``'s pool, in the rank's process (``RankWork.rank_pool``)."""
        return self.map(rank)

    def unlink(self) -> None:
        """Remove the files (mappings stay valid); those already gone are skipped."""
        for rank in range(1, self.tp):
            try:
                os.unlink(self.path(rank))
            except FileNotFoundError:
                pass
