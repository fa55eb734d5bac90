"""The shared decode pool across processes: exclusive concurrent allocation, the
reservation lifecycle with generations and leases, and recovery from processes that
die holding pages, reservations or even the lock."""
from __future__ import annotations

import time

import pytest

from tandem.rdma import ModelSpec, ReservationGone, SharedPageAllocator
from tandem.rdma.shared_pool import CANCELLED, OWNER_DIED, RESERVED, TIMEOUT, PoolError, PoolExhausted

MODEL = ModelSpec("target", 2, 2, 8, 4, "bfloat16", "HND")


def test_reservation_lifecycle_and_generations(make_pool):
    pool = make_pool([MODEL], num_pages=16, num_slots=2, context_bytes=32, fail_grace_s=0.0)
    slot, gen, pages = pool.reserve(3, expected_ops=0, timeout_s=5)
    pool.arm(slot, gen, 2)
    assert pool.poll(slot, gen).state == RESERVED and pool.stats().reserved == 3
    pool.add_completed(slot)
    assert pool.poll(slot, gen).completed == 1 and not pool.mark_ready(slot, gen + 1, 1.0)
    pool.add_completed(slot)
    assert pool.mark_ready(slot, gen, claim_lease_s=5)
    assert pool.poll(slot, gen).ready
    assert sorted(pool.claim(slot, gen)) == sorted(pages)
    st = pool.stats()
    assert (st.free, st.reserved, st.in_use) == (13, 0, 3)
    with pytest.raises(ReservationGone):
        pool.claim(slot, gen)
    pool.free(pages)
    # the slot's next reservation has a new generation; the old one reads as gone
    slot2, gen2, _ = pool.reserve(1, 1, 5)
    if slot2 == slot:
        assert gen2 == gen + 1
        assert pool.poll(slot, gen).failed and pool.poll(slot, gen).error == CANCELLED
    pool.fail(slot2, gen2, CANCELLED)
    pool.expire()
    assert pool.stats().free == 16 and pool.stats().slots_active == 0


def test_a_doomed_reservation_reads_failed_at_once_and_keeps_its_pages_until_failed(make_pool):
    """A link cut with receives posted: the decoder must learn within the transfer
    timeout, while no page of it may be handed out until its receives are given up."""
    pool = make_pool([MODEL], num_pages=8, fail_grace_s=30.0)
    slot, gen, _ = pool.reserve(4, expected_ops=3, timeout_s=5)
    pool.add_completed(slot)
    assert pool.backlog() == (1, 4)
    assert pool.doom(slot, gen, TIMEOUT)
    assert pool.backlog() == (0, 0)                       # no KV is coming for it
    st = pool.poll(slot, gen)
    assert st.failed and st.error == TIMEOUT and "transfer timeout" in st.reason
    assert pool.stats().reserved == 4 and pool.try_alloc(5) is None   # still held
    with pytest.raises(ReservationGone, match="transfer timeout"):
        pool.claim(slot, gen)
    assert not pool.mark_ready(slot, gen, 5.0)
    assert pool.fail(slot, gen, TIMEOUT)                  # its receives are over: freed
    assert pool.poll(slot, gen).error == TIMEOUT and pool.stats().free == 8
    assert not pool.doom(slot, gen, TIMEOUT)              # only a RESERVED one


def test_claim_hands_pages_over_in_the_order_reserve_gave_them(make_pool):
    """The sender writes the sequence's j-th page into the descriptor's j-th page id;
    with a fragmented free list those ids are not ascending, and the decoder's page
    table must follow the same order."""
    pool = make_pool([MODEL], num_pages=16, num_slots=2)
    held = pool.alloc(12)
    pool.free([held[i] for i in (9, 2, 7, 4, 11)])     # a scrambled free list
    slot, gen, pages = pool.reserve(5, expected_ops=1, timeout_s=5)
    assert pages != sorted(pages)
    pool.add_completed(slot)
    assert pool.mark_ready(slot, gen, claim_lease_s=5)
    assert pool.claim(slot, gen) == pages


def test_unclaimed_reservation_is_reclaimed_after_its_lease(make_pool):
    pool = make_pool([MODEL], num_pages=8, fail_grace_s=0.0)
    slot, gen, _ = pool.reserve(4, 0, 5)
    pool.mark_ready(slot, gen, claim_lease_s=0.0)
    time.sleep(0.01)
    pool.expire()
    with pytest.raises(ReservationGone, match="did not claim"):
        pool.claim(slot, gen)
    assert pool.stats().free == 8


def test_out_of_pages_and_slots_allocate_nothing(make_pool):
    pool = make_pool([MODEL], num_pages=4, num_slots=1)
    with pytest.raises(PoolExhausted):
        pool.reserve(5, 0, 1)
    assert pool.stats().free == 4 and pool.stats().slots_active == 0
    pool.reserve(1, 0, 1)
    with pytest.raises(PoolExhausted, match="slots"):
        pool.reserve(1, 0, 1)


def test_free_rejects_pages_that_are_not_the_callers(make_pool):
    pool = make_pool([MODEL], num_pages=4)
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(ValueError, match="double free"):
        pool.free(pages)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([9])


def test_allocator_interface_for_the_decode_engine(make_pool):
    alloc = SharedPageAllocator(make_pool([MODEL], num_pages=5))
    pages = alloc.alloc(4)
    assert len(set(pages)) == 4 and alloc.num_free == 1 and alloc.num_used == 4
    assert not alloc.can_alloc(2)
    alloc.free(pages)
    assert alloc.num_free == 5


def test_concurrent_allocation_from_two_processes_is_exclusive(make_pool, tx0, tx1):
    pool = make_pool([MODEL], num_pages=24)
    for p in (tx0, tx1):
        p("pool_open", pool.spec.name)
    for i, p in enumerate((tx0, tx1)):
        p.send("pool_hammer", 1500, i)
    assert [p.result(60) for p in (tx0, tx1)] == [0, 0]
    assert pool.stats().free == 24
    for p in (tx0, tx1):
        p("reset")


def test_a_dead_owners_pages_and_reservations_come_back(make_pool, fresh_peers):
    pool = make_pool([MODEL], num_pages=16, fail_grace_s=0.0)
    start = pool.stats()
    peer = fresh_peers("doomed")
    peer("pool_open", pool.spec.name)
    peer("pool_call", "alloc", 3)
    slot, gen, _ = peer("pool_call", "reserve", 5, 1, 30.0)
    assert pool.stats().free == 8
    peer.kill()
    assert pool.reclaim_dead() == 1
    st = pool.poll(slot, gen)
    assert st.failed and st.error == OWNER_DIED
    pool.expire()
    now = pool.stats()
    assert (now.free, now.reserved, now.in_use, now.slots_active) == \
        (start.free, start.reserved, start.in_use, start.slots_active)
    assert now.reclaimed_owners == 1


def test_death_while_holding_the_lock_mid_change_is_repaired(make_pool, fresh_peers):
    pool = make_pool([MODEL], num_pages=16)
    peer = fresh_peers("doomed")
    peer("pool_open", pool.spec.name)
    with pytest.raises((RuntimeError, EOFError, ConnectionError, TimeoutError)):
        peer("pool_die_mid_change", 6, timeout=10)
    peer.kill()
    # the lock died with its holder; the half-done pop is undone by the rebuild
    assert pool.stats().free == 16
    pages = pool.alloc(16)
    assert sorted(pages) == list(range(16))
    pool.free(pages)


def test_pool_memory_is_the_engines_kv_page_pool_layout(make_pool):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    pool = make_pool([ModelSpec("target", 3, 4, 8, 2, "bfloat16", "NHD")], num_pages=5)
    from tandem.backends.disagg.kv_views import shared_page_pool
    kvp = shared_page_pool(pool, 0, "target")
    assert tuple(kvp.kv.shape) == (3, 5, 2, 2, 4, 8)
    kvp.kv[2, 4] = torch.arange(kvp.kv[2, 4].numel(), dtype=torch.bfloat16).view_as(kvp.kv[2, 4])
    pb = pool.page_bytes("target")
    raw = pool.kv(0, "target")[2 * pool.layer_bytes("target") + 4 * pb:][:pb]
    assert raw.tobytes() == kvp.kv[2, 4].contiguous().view(torch.uint8).numpy().tobytes()
    assert kvp.page_bytes == pb


def test_open_of_a_missing_pool_says_so():
    from tandem.rdma import SharedKVPool
    with pytest.raises(PoolError, match="not found"):
        SharedKVPool.open("tkv-test-no-such-pool", timeout_s=0.05)


def test_the_last_process_to_close_removes_the_pool(make_pool):
    """kv_transfer and decode (and a newer version of either) share one pool: whichever
    unloads first must leave the files to the others."""
    import os

    from tandem.rdma import SharedKVPool
    pool = make_pool([MODEL], num_pages=8)
    other = SharedKVPool.open(pool.spec.name)
    files = lambda: [f for f in os.listdir("/dev/shm") if f.startswith(pool.spec.name + ".")]
    assert files()
    assert other.close(unlink_if_last=True) is False and files()
    late = SharedKVPool.open(pool.spec.name)       # a newer version attaching meanwhile
    assert pool.close(unlink_if_last=True) is False and files()
    assert late.close(unlink_if_last=True) is True and files() == []
