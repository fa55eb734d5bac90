"""The fixtures tests/rdma and tests/disagg both need, made here once: shared KV pools
with unique names (unlinked after the test), peer processes that live for the session,
and peers a test may kill."""
from __future__ import annotations

import itertools
import os
from contextlib import contextmanager

import pytest

from tandem.rdma import SharedKVPool

_names = itertools.count()


@contextmanager
def fresh_pools(prefix: str, create):
    """``make(*args, **kw)`` -> ``create(name, *args, **kw)``, a pool under a name no
    other test uses; every pool made is closed and unlinked on exit."""
    pools = []

    def make(*args, **kw):
        name = f"{prefix}-{os.getpid()}-{next(_names)}"
        SharedKVPool.unlink_stale(name)
        pool = create(name, *args, **kw)
        pools.append(pool)
        return pool

    try:
        yield make
    finally:
        for pool in pools:
            pool.close(release=False)
            pool.unlink()


@contextmanager
def started_peers(peer_cls):
    """``start(role)`` -> a ``peer_cls`` process a test may kill; every one started is
    closed (or reaped) on exit."""
    made = []

    def start(role: str):
        p = peer_cls.started(role)
        made.append(p)
        return p

    try:
        yield start
    finally:
        for p in made:
            p.close()


def session_peer(fixture_name: str, peer_cls, role: str):
    """A session fixture ``fixture_name``: a ``peer_cls`` process started as ``role``
    once, closed when the session ends."""
    @pytest.fixture(scope="session", name=fixture_name)
    def peer():
        p = peer_cls.started(role)
        yield p
        p.close()
    peer.__doc__ = f"The {role} peer process, started once for the session."
    return peer
