"""Both caching allocators keep the written contract of
:class:`~tandem.backends.kv_cache.prefix_cache.CachingKVAllocator`: the engine's own
(:class:`CachingAllocator`) and decode's on the shared pool
(:class:`SharedCachingAllocator`), which the engine uses alike."""
from __future__ import annotations

import itertools
import os

import pytest

from tandem.backends.disagg.shared_cache import SharedCachingAllocator
from tandem.backends.kv_cache import KVAllocator, PageAllocator
from tandem.backends.kv_cache.prefix_cache import CachingAllocator, CachingKVAllocator
from tandem.rdma import PoolSpec, SharedKVPool, SharedPageAllocator
from tandem.rdma.plan import ModelSpec

K = [bytes([i]) * 16 for i in range(4)]   # the shared pool keys pages by 16 bytes
_names = itertools.count()


@pytest.fixture
def shared_pool():
    name = f"tkv-contract-{os.getpid()}-{next(_names)}"
    SharedKVPool.unlink_stale(name)
    pool = SharedKVPool.create(PoolSpec(name, (ModelSpec("t", 1, 1, 4, 2, "uint8"),), 4,
                                        max_pins=4))
    yield pool
    pool.close(unlink_if_last=True)


@pytest.fixture(params=["CachingAllocator", "SharedCachingAllocator"])
def allocator(request, shared_pool):
    """A caching allocator of 4 pages."""
    if request.param == "CachingAllocator":
        return CachingAllocator(4)
    return SharedCachingAllocator(shared_pool, root=bytes(16))


def test_caching_allocators_are_told_from_plain_ones(allocator, shared_pool):
    assert isinstance(allocator, CachingKVAllocator) and isinstance(allocator, KVAllocator)
    assert not isinstance(PageAllocator(4), CachingKVAllocator)
    assert not isinstance(SharedPageAllocator(shared_pool), CachingKVAllocator)


def test_publish_match_free_and_evict(allocator):
    a = allocator
    p = a.alloc(2)
    assert [a.ref_count(x) for x in p] == [1, 1]
    assert a.publish(p[0], K[0])
    assert not a.publish(p[1], K[0])      # a key is cached once: the copy stays private
    assert not a.publish(p[0], K[1])      # a page has one key
    assert a.publish(p[1], K[1])
    a.free(p)                             # last first: p[1] is the least recently freed
    assert (a.num_free, a.num_cached) == (4, 2)   # evictable pages count as free
    assert a.lookup([K[0], K[1], K[2]]) == 2 and a.num_free == 4   # takes nothing
    got = a.match([K[0], K[2], K[1]])     # the prefix stops at the first miss
    assert got == p[:1] and a.ref_count(p[0]) == 1 and a.num_free == 3
    a.free(got)
    fresh = a.alloc(2)                    # pages without a key go first
    assert not set(fresh) & set(p) and a.num_cached == 2
    assert a.alloc(1) == [p[1]]           # then the least recently freed cached page
    assert a.lookup([K[1]]) == 0 and a.lookup([K[0]]) == 1 and a.stats.evictions == 1
    with pytest.raises(ValueError, match="not allocated"):
        a.publish(p[0], K[3])             # only a held page is published


def test_withdraw_spares_pages_another_holder_shares(allocator):
    a = allocator
    p = a.alloc(2)
    a.publish(p[0], K[0]), a.publish(p[1], K[1])
    shared = a.match([K[0]])              # another sequence holds p[0] too
    assert a.withdraw(p) == 1
    assert a.lookup([K[0]]) == 1 and a.lookup([K[1]]) == 0
    a.free(p)
    a.free(shared)
    assert (a.num_cached, a.num_free) == (1, 4)


def test_reset_drops_every_key_and_leaves_held_pages_with_their_holder(allocator):
    a = allocator
    p = a.alloc(2)
    a.publish(p[0], K[0]), a.publish(p[1], K[1])
    a.free(p[1:])
    assert a.reset() == 2 and a.num_cached == 0 and a.lookup([K[0]]) == 0
    assert a.ref_count(p[0]) == 1 and a.num_free == 3
    a.free(p[:1])
    assert a.num_free == 4
