"""The shared pool under pressure and attack: a reservation's secret is what entitles
a claim; allocation is decided under the lock; reservations leave the decoder its
headroom; failed slots never block a reservation while pages are free; a cancel
frees a READY reservation at once and flags a RESERVED one for its receiver; a pool
file of a dead server is replaced, one of a live server refused."""
from __future__ import annotations

import os
import secrets
import signal

import pytest

from tandem.rdma import ModelSpec, PoolError, PoolExhausted, ReservationGone, SharedKVPool
from tandem.rdma.pool_layout import PoolOwner, PoolSpec, pool_owner
from tandem.rdma.shared_pool import CANCELLED, FAILED, RESERVED, TIMEOUT, SharedPageAllocator

from .peers import wait_for

MODEL = ModelSpec("target", 2, 2, 8, 4, "bfloat16", "HND")


def ready(pool, n, secret=None):
    secret = secret or secrets.token_bytes(16)
    slot, gen, pages = pool.reserve(n, 1, 30.0, secret)
    pool.add_completed(slot)
    assert pool.mark_ready(slot, gen, 30.0)
    return slot, gen, pages, secret


def test_only_the_secret_claims_a_reservation(make_pool):
    pool = make_pool([MODEL], num_pages=8)
    slot, gen, pages, secret = ready(pool, 3)
    assert pool.verify(slot, gen, secret) and not pool.verify(slot, gen, bytes(16))
    assert not pool.verify(slot, gen + 1, secret) and not pool.verify(99, gen, secret)
    with pytest.raises(ReservationGone, match="wrong secret"):
        pool.claim(slot, gen, bytes(16))
    assert pool.poll(slot, gen).ready        # the forged claim took nothing
    assert pool.claim(slot, gen, secret) == pages


def test_an_out_of_range_slot_reads_as_gone_not_an_error(make_pool):
    pool = make_pool([MODEL], num_pages=8, num_slots=4)
    st = pool.poll(4, 1)
    assert st.failed and st.error == CANCELLED
    with pytest.raises(ReservationGone, match="out of range"):
        pool.claim(4, 1)
    assert not pool.cancel(10**6, 1, bytes(16))


def test_cancel_frees_a_ready_reservation_at_once_and_flags_a_reserved_one(make_pool):
    pool = make_pool([MODEL], num_pages=8)
    slot, gen, _, secret = ready(pool, 3)
    assert not pool.cancel(slot, gen, bytes(16))           # a wrong secret cancels nothing
    assert pool.cancel(slot, gen, secret)
    st = pool.poll(slot, gen)
    assert st.failed and st.error == CANCELLED and pool.stats().free == 8
    secret2 = secrets.token_bytes(16)
    slot2, gen2, _ = pool.reserve(2, 4, 30.0, secret2)
    assert not pool.cancel_requested(slot2, gen2)
    assert pool.cancel(slot2, gen2, secret2)
    # receives may be in flight: the receiver frees the pages, not the decoder
    assert pool.cancel_requested(slot2, gen2) and pool.poll(slot2, gen2).state == RESERVED
    assert pool.stats().cancelled_reservations == 2


def test_reservations_leave_the_headroom_to_the_decoder(make_pool):
    pool = make_pool([MODEL], num_pages=10, headroom_pages=3)
    assert pool.max_reservable_pages() == 7
    pool.reserve(5, 1, 30.0)
    with pytest.raises(PoolExhausted, match="kept for running sequences"):
        pool.reserve(3, 1, 30.0)
    alloc = SharedPageAllocator(pool)
    assert len(alloc.try_alloc(5)) == 5                     # the decoder may use all of it
    assert alloc.try_alloc(1) is None and pool.stats().free == 0


def test_try_alloc_decides_under_the_lock(make_pool, tx0):
    """Another process reserves between a free-count read and an allocation: the
    decoder's try_alloc answers None instead of raising."""
    pool = make_pool([MODEL], num_pages=6)
    alloc = SharedPageAllocator(pool)
    assert alloc.can_alloc(4)
    tx0("pool_open", pool.spec.name)
    tx0("pool_call", "reserve", 4, 1, 30.0)                 # kv_transfer, in between
    assert alloc.try_alloc(4) is None and pool.stats().free == 2
    with pytest.raises(PoolExhausted):
        alloc.alloc(4)
    tx0("reset")


def test_failed_slots_never_block_a_reservation_while_pages_are_free(make_pool):
    pool = make_pool([MODEL], num_pages=16, num_slots=2, fail_grace_s=3600)
    for _ in range(2):
        slot, gen, _ = pool.reserve(1, 1, 30.0)
        pool.fail(slot, gen, TIMEOUT)
    assert pool.stats().free == 16
    slot, gen, _ = pool.reserve(2, 1, 30.0)                 # every slot FAILED, in its grace
    assert pool.poll(slot, gen).state == RESERVED


# -- whose pool file is it ------------------------------------------------------------------
def _spec(make_pool_name: str) -> PoolSpec:
    return PoolSpec(make_pool_name, (MODEL,), num_pages=8)


@pytest.fixture
def pool_name():
    name = f"tkv-owner-{os.getpid()}-{secrets.token_hex(3)}"
    yield name
    SharedKVPool.unlink_stale(name)


def test_a_dead_servers_pool_file_is_replaced(pool_name, fresh_peers):
    peer = fresh_peers("old-server")
    peer("pool_create", _spec(pool_name))
    peer("pool_call", "reserve", 5, 1, 30.0)
    peer.kill()
    assert pool_owner(pool_name, os.getpid())[0] is PoolOwner.STALE
    pool = SharedKVPool.open_or_create(_spec(pool_name), server_pid=os.getpid())
    try:
        assert pool.stats().free == 8 and pool.stats().slots_active == 0   # a fresh pool
        assert pool_owner(pool_name, os.getpid())[0] is PoolOwner.OURS
    finally:
        pool.close(unlink_if_last=True)


def test_a_creator_killed_half_way_leaves_a_stale_file(pool_name, fresh_peers):
    peer = fresh_peers("half-creator")
    peer("pool_half_create", _spec(pool_name), os.getpid())
    assert pool_owner(pool_name, os.getpid())[0] is PoolOwner.OURS   # still creating
    peer.kill()
    assert pool_owner(pool_name, os.getpid())[0] is PoolOwner.STALE
    pool = SharedKVPool.open_or_create(_spec(pool_name), server_pid=os.getpid(), timeout_s=5)
    pool.close(unlink_if_last=True)


def test_a_live_servers_pool_is_refused(pool_name, fresh_peers):
    peer = fresh_peers("live-server")
    peer("pool_create", _spec(pool_name))
    with pytest.raises(PoolError, match=f"another live server \\(pid {peer.pid}\\)"):
        SharedKVPool.open_or_create(_spec(pool_name), server_pid=os.getpid(), timeout_s=5)
    assert peer("pool_call", "stats").free == 8      # untouched


def test_processes_of_one_server_share_its_pool(pool_name, fresh_peers):
    peer = fresh_peers("sibling")
    peer("pool_create", _spec(pool_name), os.getpid())    # created for this (test) server
    slot, gen, _ = peer("pool_call", "reserve", 3, 1, 30.0)
    pool = SharedKVPool.open_or_create(_spec(pool_name), server_pid=os.getpid(), timeout_s=5)
    try:
        assert pool.poll(slot, gen).state == RESERVED
        with pytest.raises(PoolError, match="another geometry"):
            SharedKVPool.open_or_create(PoolSpec(pool_name, (MODEL,), num_pages=9),
                                        server_pid=os.getpid(), timeout_s=5)
    finally:
        pool.close(release=False)


def test_any_attached_process_reclaims_a_dead_owner(make_pool, fresh_peers):
    """decode's housekeeping, not only kv_transfer's: the dead one's reservations fail,
    even while the dead process is a zombie its parent has not reaped (a SIGKILLed
    stub, until tritonserver waits for it)."""
    pool = make_pool([MODEL], num_pages=8, fail_grace_s=0.0)
    decode = fresh_peers("decode")
    decode("pool_open", pool.spec.name)
    kv_transfer = fresh_peers("kv-transfer-doomed")
    kv_transfer("pool_open", pool.spec.name)
    slot, gen, _ = kv_transfer("pool_call", "reserve", 5, 1, 30.0)
    os.kill(kv_transfer.pid, signal.SIGKILL)       # not reaped: a zombie
    wait_for(lambda: open(f"/proc/{kv_transfer.pid}/stat").read().split(") ")[1][0] == "Z")
    assert decode("pool_call", "housekeep") == 1
    st = pool.poll(slot, gen)
    assert st.state == FAILED and st.reason_code == "owner_died"
    assert pool.stats().free == 8
