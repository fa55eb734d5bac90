"""Fixtures for the KV transfer tests: shared pools with unique names, and long-lived
peer processes (a receiver host and two sender ranks) reused across tests."""
from __future__ import annotations

import pytest

from tandem.rdma import PoolSpec, SharedKVPool

from .fixtures import fresh_pools, session_peer, started_peers
from .peers import Peer


@pytest.fixture
def make_pool():
    """``make_pool(models, num_pages, **spec)`` -> a fresh SharedKVPool, unlinked afterwards."""
    def create(name, models, num_pages, fail_grace_s=30.0, **kw):
        return SharedKVPool.create(PoolSpec(name, tuple(models), num_pages, **kw), fail_grace_s=fail_grace_s)
    with fresh_pools("tkv-test", create) as make:
        yield make


rx = session_peer("rx", Peer, "rx")
tx0 = session_peer("tx0", Peer, "tx0")
tx1 = session_peer("tx1", Peer, "tx1")


@pytest.fixture
def fresh_peers():
    """Peers that a test may kill; closed (or reaped) afterwards."""
    with started_peers(Peer) as start:
        yield start
