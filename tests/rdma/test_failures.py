"""Failures between real processes: a side dies mid-transfer or cannot be reached, and
a late message arrives for a reclaimed reservation. Every failure ends in a clear
error, never a hang, and the pool's page counters return to their starting values."""
from __future__ import annotations

import dataclasses
import time

import pytest

from tandem.rdma import DestinationDescriptor, ModelSpec, ReservationGone
from tandem.rdma.shared_pool import FAILED, READY, SENDER_ERROR, TIMEOUT

from .peers import data_tag, payload, wait_for

SPEC = ModelSpec("target", 6, 2, 8, 4, "bfloat16", "HND")
# 16 KiB pages: rendezvous sends, which stay pending while nobody reads them (small
# eager sends complete at once, the data copied out: nothing to wait for)
BIG = ModelSpec("target", 6, 4, 64, 16, "bfloat16", "HND")


def counters(pool):
    s = pool.stats()
    return s.free, s.reserved, s.in_use, s.slots_active


def settle(pool, start, timeout=5.0):
    """Poll until the pool's counters are back at ``start`` (housekeeping runs on ticks)."""
    deadline = time.monotonic() + timeout
    while counters(pool) != start and time.monotonic() < deadline:
        pool.reclaim_dead()
        pool.expire()
        time.sleep(0.02)
    return counters(pool)


def test_sender_dies_mid_transfer(make_pool, rx, fresh_peers):
    pool = make_pool([SPEC], num_pages=32)
    start = counters(pool)
    rx("rx_start", pool.spec.name, fail_grace_s=0.0)
    tx = fresh_peers("prefill-doomed")
    tx("tx_start", [SPEC], 16, rank=0)
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 30, max_run_pages=1, timeout_s=0.5))
    with pytest.raises((RuntimeError, EOFError, ConnectionError)):
        tx("tx_run", [(d.to_bytes(), list(range(8)))], layer_delay_s=0.02, die_after_layers=2)
    state, completed, expected, error = rx("rx_wait", d.slot, d.generation)
    assert state == FAILED and error in (TIMEOUT, SENDER_ERROR)
    assert 0 < completed < expected      # the first layers did land
    with pytest.raises(ReservationGone, match="failed: .*prefill"):
        pool.claim(d.slot, d.generation)
    assert settle(pool, start) == start


def test_receiver_dies_mid_transfer(make_pool, tx0, fresh_peers):
    pool = make_pool([BIG], num_pages=32)
    start = counters(pool)
    rx = fresh_peers("kv-transfer-doomed")
    rx("rx_start", pool.spec.name)
    tx0("tx_start", [BIG], 16, rank=0, timeout_s=0.5)
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 120, max_run_pages=1))
    tx0.send("tx_run", [(d.to_bytes(), list(range(8)))], layer_delay_s=0.1, wait_s=10)
    time.sleep(0.35)
    rx.kill()
    t0 = time.monotonic()
    [res] = tx0.result(30)
    assert res["error"] is not None and time.monotonic() - t0 < 5
    state = tx0("tx_state")
    assert state["freed"] == [8], "prefill frees its pages after the timeout"
    assert (state["active"], state["peers"]) == (0, 0)
    assert settle(pool, start) == start   # the dead receiver's reservation is reclaimed


def test_unreachable_receiver_fails_fast_and_leaks_nothing(make_pool, tx0, fresh_peers):
    pool = make_pool([SPEC], num_pages=32)
    start = counters(pool)
    rx = fresh_peers("kv-transfer-gone")
    rx("rx_start", pool.spec.name)
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 9))
    rx.kill()
    tx0("tx_start", [SPEC], 16, rank=0, connect_timeout_s=2.0)
    t0 = time.monotonic()
    [res] = tx0("tx_run", [(d.to_bytes(), [1, 2, 3])], wait_s=10)
    assert res["error"].startswith("PeerUnreachable") and time.monotonic() - t0 < 5
    state = tx0("tx_state")
    assert (state["active"], state["peers"], state["freed"]) == (0, 0, [3])
    assert settle(pool, start) == start


def test_silent_peer_fails_the_handshake(make_pool, rx, tx0, tx1):
    pool = make_pool([SPEC], num_pages=32)
    start = counters(pool)
    rx("rx_start", pool.spec.name, fail_grace_s=0.0)
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 9, timeout_s=0.3))
    silent = tx1("raw_start")   # a live UCX worker that never answers
    d = dataclasses.replace(d, worker_address=silent, _plan=None)
    tx0("tx_start", [SPEC], 16, rank=0, connect_timeout_s=0.3)
    [res] = tx0("tx_run", [(d.to_bytes(), [1, 2, 3])], wait_s=10)
    assert res["error"].startswith("PeerUnreachable") and "handshake" in res["error"]
    assert tx0("tx_state")["active"] == 0
    state, *_ = rx("rx_wait", d.slot, d.generation)
    assert state == FAILED   # the reservation, never fed, timed out on its own
    assert settle(pool, start) == start
    tx1("reset")


def test_late_message_for_a_reclaimed_reservation_never_lands(make_pool, rx, tx1):
    spec = ModelSpec("target", 1, 2, 4, 2, "float32", "HND")
    pool = make_pool([spec], num_pages=4, num_slots=1)
    start = counters(pool)
    address = rx("rx_start", pool.spec.name, fail_grace_s=0.0)
    old = DestinationDescriptor.from_bytes(rx("rx_reserve", 2, timeout_s=0.2))
    state, *_ = rx("rx_wait", old.slot, old.generation)
    assert state == FAILED
    settle(pool, start)
    new = DestinationDescriptor.from_bytes(rx("rx_reserve", 2, timeout_s=30))
    # the same slot and the same page, owned by a new reservation
    assert (new.slot, new.page_ids) == (old.slot, old.page_ids)
    assert new.generation == old.generation + 1
    assert new.tag_key != old.tag_key    # a fresh secret: the old one's tags name nothing
    page = spec.page_bytes(2)
    tx1("raw_start")
    tx1("raw_open", address, new.to_bytes())
    wait_for(lambda: rx("rx_stats")["handshakes"] >= 1)
    sends = [(data_tag(new.tag_key, 0), payload(page, 0x11)),
             (data_tag(old.tag_key, 0), payload(page, 0xEE))]   # late, stale
    assert tx1("raw_send", address, sends) == ["ok", "ok"]
    state, completed, expected, _ = rx("rx_wait", new.slot, new.generation)
    assert state == READY and completed == expected == 1
    assert rx("rx_stats")["dropped_stale"] >= 1
    kv = pool.kv(0, "target").reshape(1, 4, -1)
    assert (kv[0, new.page_ids[0]] == 0x11).all(), "the new owner's page is untouched"
    pool.free(pool.claim(new.slot, new.generation))
    assert settle(pool, start) == start
    tx1("reset")
