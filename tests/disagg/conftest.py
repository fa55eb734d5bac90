"""Fixtures: long-lived kv_transfer (receiver) and prefill peer processes, and fresh
shared decode pools."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from .peers import Peer

torch.set_num_threads(1)
_names = itertools.count()


@pytest.fixture(scope="session")
def rx_peer():
    p = Peer.started("kv_transfer")
    yield p
    p.close()


@pytest.fixture(scope="session")
def prefill_peer():
    p = Peer.started("prefill")
    yield p
    p.close()


@pytest.fixture
def make_decode_pool():
    """``make_decode_pool(model_dir, **spec)`` -> a fresh SharedKVPool, unlinked afterwards."""
    from tandem.backends.disagg import decode_pool_spec
    from tandem.rdma import SharedKVPool
    pools = []

    def make(model_dir, dtype="float32", page_size=4, kv_layout="HND", num_pages=64,
             speculative=None, prefix_caching=False):
        name = f"tkv-disagg-{os.getpid()}-{next(_names)}"
        SharedKVPool.unlink_stale(name)
        pool = SharedKVPool.create(decode_pool_spec(name, str(model_dir), dtype, page_size,
                                                    kv_layout, num_pages, speculative=speculative,
                                                    prefix_caching=prefix_caching))
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close(release=False)
        pool.unlink()
