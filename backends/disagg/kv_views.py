"""The engine's KV page pools as the KV transfer sees them, and back.

:mod:`tandem.rdma` knows memory only as geometry plus flat bytes; the engine knows
its :class:`~tandem.backends.kv_cache.KVPagePool`. These two views are the whole
boundary between them (no Triton here):

- :func:`shared_page_pool` — a ``KVPagePool`` over one decode rank's KV in a
  :class:`~tandem.rdma.SharedKVPool` (the decode engine's cache), and
  :class:`RankShare`, the same mapped by name in a tensor-parallel rank's process;
- :func:`source_pool` — a prefill engine's ``KVPagePool`` as a
  :class:`~tandem.rdma.SourcePool` (what :class:`~tandem.rdma.KVSender` sends from).

>>> from tandem.backends.kv_cache import KVPagePool
>>> src = source_pool("target", KVPagePool(2, 3, 2, 4, 8, torch.float32))
>>> src.spec.num_kv_heads, src.num_pages, src.layer_bytes
(2, 3, 1536)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.rdma import ModelSpec, SharedKVPool, ShardScheme, SourcePool
from tandem.rdma.pool_layout import kv_path, map_file, read_spec

from ..kv_cache import KVPagePool


def shared_page_pool(pool: SharedKVPool, rank: int, model: str) -> KVPagePool:
    """A :class:`KVPagePool` over ``pool``'s shared memory of decode rank ``rank`` and
    ``model`` (no copy: writes land in the shared pool)."""
    m = pool.model(model)
    return KVPagePool(m.num_layers, pool.spec.num_pages,
                      m.heads_per_rank(pool.spec.scheme), m.page_size,
                      m.head_dim, getattr(torch, m.dtype), m.kv_layout,
                      buffer=torch.frombuffer(pool.kv(rank, model), dtype=torch.uint8))


@dataclass(frozen=True, slots=True)
class RankShare:
    """One model's KV of decode rank ``rank`` in a shared pool, by the pool's name: what a
    tensor-parallel rank process maps (``RankShare(pool_name, model)(rank)``), without
    the control block: the leader's process owns the pool's pages and reservations."""
    pool_name: str
    model: str

    def __call__(self, rank: int) -> KVPagePool:
        spec = read_spec(self.pool_name)
        m = next(x for x in spec.models if x.name == self.model)
        _, mapping = map_file(kv_path(spec.name, rank, m.name), spec.kv_bytes(m), create=False)
        return KVPagePool(m.num_layers, spec.num_pages, m.heads_per_rank(spec.scheme), m.page_size,
                          m.head_dim, getattr(torch, m.dtype), m.kv_layout,
                          buffer=torch.frombuffer(mapping, dtype=torch.uint8))


def source_pool(name: str, page_pool: KVPagePool,
                scheme: ShardScheme = ShardScheme(1)) -> SourcePool:
    """``page_pool`` (one prefill rank of ``scheme``, holding model ``name``) as a
    :class:`SourcePool`: its memory as flat bytes (a numpy view on CPU, the tensor
    itself on GPU)."""
    flat = page_pool.kv.reshape(-1).view(torch.uint8)
    data = flat.numpy() if flat.device.type == "cpu" else flat
    spec = ModelSpec(name, page_pool.num_layers, page_pool.num_kv_heads * scheme.ranks_per_set,
                     page_pool.head_dim, page_pool.page_size,
                     str(page_pool.kv.dtype).removeprefix("torch."), page_pool.kv_layout)
    return SourcePool(spec, page_pool.num_kv_heads, page_pool.num_pages, data)
