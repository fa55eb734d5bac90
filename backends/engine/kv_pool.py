"""An engine's own KV memory, built from its config: the target's page pool and the
allocator of its page ids (one that caches prefixes when ``enable_prefix_caching``),
and a pool for a proposer's KV, which takes the same page ids.

>>> from tandem.backends.models.config import ModelConfig
>>> cfg = ModelConfig.from_dir("checkpoints/demo/target")
>>> pool, allocator = make_kv_pool(EngineConfig("checkpoints/demo/target", num_pages=8), cfg,
...                                torch.float32)
>>> pool.num_pages, type(allocator).__name__
(8, 'CachingAllocator')
"""
from __future__ import annotations

import torch

from ..kv_cache import KVAllocator, KVPagePool, PageAllocator
from ..kv_cache.page_pool import KVShape
from ..kv_cache.prefix_cache import CachingAllocator
from ..models.config import ModelConfig
from .config import EngineConfig


def make_kv_pool(config: EngineConfig, model_config: ModelConfig,
                 dtype: torch.dtype) -> tuple[KVPagePool, KVAllocator]:
    """The target's KV pool (``config.num_pages_for(model_config)`` pages, laid out as
    ``config`` says) and its allocator: a
    :class:`~tandem.backends.kv_cache.prefix_cache.CachingAllocator` with
    ``config.enable_prefix_caching``, else a plain
    :class:`~tandem.backends.kv_cache.PageAllocator`."""
    num_pages = config.num_pages_for(model_config)
    allocator = (CachingAllocator(num_pages) if config.enable_prefix_caching
                 else PageAllocator(num_pages))
    return kv_page_pool(config, model_config, num_pages, dtype), allocator


def kv_page_pool(config: EngineConfig, model: KVShape, num_pages: int,
                 dtype: torch.dtype) -> KVPagePool:
    """A pool of ``num_pages`` for ``model``'s KV with ``config``'s page size, layout and
    device (a proposer's pool has the target's ``num_pages``: they share page ids)."""
    return KVPagePool.for_model(model, num_pages, config.page_size, dtype, config.kv_layout,
                                config.device)


def check_pool_fits(config: EngineConfig, pool: KVPagePool, model: KVShape, dtype: torch.dtype) -> None:
    """An external KV pool must have ``model``'s geometry and ``config``'s layout."""
    want = (model.num_hidden_layers, model.num_key_value_heads, model.head_dim, config.page_size,
            config.kv_layout, dtype)
    have = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size, pool.kv_layout,
            pool.kv.dtype)
    if want != have:
        raise ValueError(f"external KV pool (layers, kv heads, head_dim, page_size, layout, "
                         f"dtype) = {have}; the model and engine config need {want}")
