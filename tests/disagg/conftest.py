"""Fixtures: long-lived kv_transfer (receiver) and prefill peer processes, and fresh
shared decode pools."""
from __future__ import annotations

import pytest
import torch

from ..rdma.fixtures import fresh_pools, session_peer
from .peers import Peer

torch.set_num_threads(1)

rx_peer = session_peer("rx_peer", Peer, "kv_transfer")
prefill_peer = session_peer("prefill_peer", Peer, "prefill")


@pytest.fixture
def make_decode_pool():
    """``make_decode_pool(model_dir, **spec)`` -> a fresh SharedKVPool, unlinked afterwards."""
    from tandem.backends.disagg import decode_pool_spec
    from tandem.rdma import SharedKVPool

    def create(name, model_dir, dtype="float32", page_size=4, kv_layout="HND", num_pages=64,
               speculative=None, prefix_caching=False, tp=1):
        return SharedKVPool.create(decode_pool_spec(name, str(model_dir), dtype, page_size, kv_layout,
                                                    num_pages, speculative=speculative,
                                                    prefix_caching=prefix_caching, tp=tp))
    with fresh_pools("tkv-disagg", create) as make:
        yield make
