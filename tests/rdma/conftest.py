"""Fixtures for the KV transfer tests: shared pools with unique names, and long-lived
peer processes (a receiver host and two sender ranks) reused across tests."""
from __future__ import annotations

import itertools
import os

import pytest

from tandem.rdma import PoolSpec, SharedKVPool

from .peers import Peer

_names = itertools.count()


@pytest.fixture
def make_pool():
    """``make_pool(models, num_pages, **spec)`` -> a fresh SharedKVPool, unlinked afterwards."""
    pools = []

    def make(models, num_pages, fail_grace_s=30.0, **kw):
        name = f"tkv-test-{os.getpid()}-{next(_names)}"
        SharedKVPool.unlink_stale(name)
        pool = SharedKVPool.create(PoolSpec(name, tuple(models), num_pages, **kw),
                                   fail_grace_s=fail_grace_s)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close(release=False)
        pool.unlink()


@pytest.fixture(scope="session")
def rx():
    p = Peer.started("rx")
    yield p
    p.close()


@pytest.fixture(scope="session")
def tx0():
    p = Peer.started("tx0")
    yield p
    p.close()


@pytest.fixture(scope="session")
def tx1():
    p = Peer.started("tx1")
    yield p
    p.close()


@pytest.fixture
def fresh_peers():
    """Peers that a test may kill; closed (or reaped) afterwards."""
    made = []

    def make(name):
        p = Peer.started(name)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
