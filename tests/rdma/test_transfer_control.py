"""The KV control plane between real processes: a transfer is opened with the
reservation's secret, so a forged descriptor can neither write nor finish another
request's KV; the decoder's cancel stops the receiver and the sender; a sender killed
mid-rendezvous (TCP) leaves the reservation failed and its pages back; a draining
receiver finishes what it started; injected faults fail transfers where asked."""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import time

import numpy as np
import pytest

from tandem.rdma import DestinationDescriptor, ModelSpec
from tandem.rdma.shared_pool import (CANCELLED, FAILED, INJECTED, PREFILL_FAILED, READY, RESERVED, SENDER_ERROR,
                                     TIMEOUT)

from .peers import data_tag, expected_dst_page, full_kv, payload, wait_for

SPEC = ModelSpec("target", 6, 2, 8, 4, "bfloat16", "HND")
SRC_PAGES = 16


def counters(pool):
    s = pool.stats()
    return s.free, s.reserved, s.in_use, s.slots_active


def settle(pool, start, timeout=10.0):
    deadline = time.monotonic() + timeout
    while counters(pool) != start and time.monotonic() < deadline:
        pool.housekeep()
        time.sleep(0.02)
    return counters(pool)


def reserve(rx, n=30, **kw) -> DestinationDescriptor:
    return DestinationDescriptor.from_bytes(rx("rx_reserve", n, max_run_pages=1, **kw))


def test_a_forged_descriptor_cannot_feed_another_requests_reservation(make_pool, rx, tx0):
    pool = make_pool([SPEC], num_pages=32, fail_grace_s=0.0)
    start = counters(pool)
    rx("rx_start", pool.spec.name)
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0, seed=3)
    victim = reserve(rx)
    forged = dataclasses.replace(victim, secret=secrets.token_bytes(16), _plan=None)
    [res] = tx0("tx_run", [(forged.to_bytes(), list(range(8)))], wait_s=10)
    assert res["error"].startswith("TransferCancelled") and "wrong secret" in res["error"]
    assert res["sent"] == 0 and rx("rx_stats")["refused"] == 1
    sent = tx0("tx_state")["stats"]
    assert (sent["transfers"], sent["refused"], sent["failed"]) == (1, 1, 1)
    st = pool.poll(victim.slot, victim.generation)
    assert st.state == RESERVED and st.completed == 0      # untouched
    src_pages = [9, 2, 3, 4, 11, 12, 13, 0]
    [res] = tx0("tx_run", [(victim.to_bytes(), src_pages)], wait_s=10, context=False)
    assert res["error"] is None
    assert rx("rx_wait", victim.slot, victim.generation)[0] == READY
    pages = pool.claim(victim.slot, victim.generation, victim.secret)
    full = full_kv(SPEC, SRC_PAGES, 3)
    got = pool.kv(0, "target").reshape(SPEC.num_layers, 32, -1)
    for k, page in enumerate(pages):
        np.testing.assert_array_equal(got[:, page],
                                      expected_dst_page(full, "HND", src_pages[k], (0, 2)))
    pool.free(pages)
    assert settle(pool, start) == start


def test_data_lands_only_after_an_open_and_under_the_secrets_key(make_pool, rx, tx1):
    pool = make_pool([SPEC], num_pages=32)
    address = rx("rx_start", pool.spec.name)
    d = reserve(rx, 3)
    page = SPEC.page_bytes(2)
    tx1("raw_start")
    # the right key, but nobody proved the secret: dropped
    assert tx1("raw_send", address, [(data_tag(d.tag_key, 0), payload(page, 0xEE))]) == ["ok"]
    wait_for(lambda: rx("rx_stats")["dropped_unopened"] == 1)
    wrong = secrets.token_bytes(16)
    tx1("raw_open", address, d.to_bytes(), wrong)
    wait_for(lambda: rx("rx_stats")["refused"] == 1)
    # a forger's key names nothing
    assert tx1("raw_send", address, [(data_tag(int.from_bytes(wrong[:4], "little"), 0),
                                      payload(page, 0xEE))]) == ["ok"]
    wait_for(lambda: rx("rx_stats")["dropped_stale"] >= 1)
    assert pool.poll(d.slot, d.generation).completed == 0
    kv = pool.kv(0, "target").reshape(SPEC.num_layers, 32, -1)
    assert not (kv[:, list(d.page_ids)] == 0xEE).any()
    tx1("reset")


def test_a_cancel_stops_the_receiver_and_the_prefill_side(make_pool, rx, tx0):
    pool = make_pool([SPEC], num_pages=32, fail_grace_s=30.0)
    start = counters(pool)
    rx("rx_start", pool.spec.name)
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0)
    d = reserve(rx)
    tx0.send("tx_run", [(d.to_bytes(), list(range(8)))], layer_delay_s=0.3, wait_s=30)
    wait_for(lambda: pool.poll(d.slot, d.generation).completed > 0)
    assert pool.cancel(d.slot, d.generation, d.secret)        # the decoder gives up
    state, completed, expected, error = rx("rx_wait", d.slot, d.generation)
    assert state == FAILED and error == CANCELLED and completed < expected
    [res] = tx0.result(30)
    assert res["error"].startswith("TransferCancelled") and "cancelled" in res["error"]
    assert res["completed"] < res["total"]
    assert tx0("tx_state")["freed"] == [8]                    # prefill's pages released
    assert settle(pool, start) == start
    assert rx("rx_stats")["cancelled"] == 1


# 256 KiB pages, runs of 128: 32 MiB rendezvous messages, ~0.1 s each over tcp
BIG = ModelSpec("target", 6, 8, 128, 64, "bfloat16", "HND")


@pytest.fixture
def tcp_peers(fresh_peers):
    """Peers whose UCX may use TCP only (no shared memory, no CMA): a rendezvous
    receive from a dead sender never completes by itself there."""
    old = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp,self"
    try:
        yield fresh_peers("kv-transfer-tcp"), fresh_peers("prefill-tcp")
    finally:
        if old is None:
            del os.environ["UCX_TLS"]
        else:
            os.environ["UCX_TLS"] = old


def test_a_sender_killed_mid_rendezvous_leaves_the_reservation_failed_and_pages_back(
        make_pool, tcp_peers):
    rx, tx = tcp_peers
    pool = make_pool([BIG], num_pages=160, fail_grace_s=30.0)
    start = counters(pool)
    rx("rx_start", pool.spec.name, timeout_s=60.0, drain_timeout_s=60.0)   # neither saves us
    tx("tx_start", [BIG], 128, rank=0)
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 64 * 128, max_run_pages=128))
    tx.send("tx_run", [(d.to_bytes(), list(range(128)))], context=False)
    wait_for(lambda: pool.poll(d.slot, d.generation).completed >= 1, timeout_s=60)
    tx.kill()                                   # the next layers' receives are in flight
    state, completed, expected, error = rx("rx_wait", d.slot, d.generation, 30.0)
    assert state == FAILED and error == SENDER_ERROR and completed < expected
    stats = rx("rx_stats")
    assert stats["senders_lost"] == 1 and stats["abandoned_receives"] >= 1
    assert settle(pool, start) == start


def test_a_draining_receiver_finishes_what_it_started(make_pool, rx, tx0):
    pool = make_pool([SPEC], num_pages=32)
    start = counters(pool)
    rx("rx_start", pool.spec.name)
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0)
    d = reserve(rx)
    tx0.send("tx_run", [(d.to_bytes(), list(range(8)))], layer_delay_s=0.1, context=False)
    rx.send("rx_drain", 30.0)                   # a version roll: this instance unloads
    wait_for(lambda: pool.poll(d.slot, d.generation).ready, timeout_s=30)
    pool.free(pool.claim(d.slot, d.generation, d.secret))    # decode claims it
    assert rx.result(30) is True
    assert tx0.result(30)[0]["error"] is None
    with pytest.raises(RuntimeError, match="draining"):
        rx("rx_reserve", 4)
    assert counters(pool) == start


@pytest.mark.parametrize("point,lands", [("before_first_layer", "none"), ("mid_layers", "some"),
                                         ("at_counter", "all")])
def test_injected_transfer_faults_fail_where_asked(point, lands, make_pool, rx, tx0):
    pool = make_pool([SPEC], num_pages=32, fail_grace_s=30.0)
    start = counters(pool)
    rx("rx_start", pool.spec.name, faults=f"transfer_fail=1@{point}")
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0)
    d = reserve(rx)
    [res] = tx0("tx_run", [(d.to_bytes(), list(range(8)))], context=False, wait_s=10)
    state, completed, expected, error = rx("rx_wait", d.slot, d.generation)
    assert state == FAILED and error == INJECTED
    assert {"none": completed == 0, "some": 0 < completed < expected,
            "all": completed == expected}[lands]
    assert pool.poll(d.slot, d.generation).reason == "a fault was injected (TANDEM_FAULTS)"
    if lands == "none":     # later, small eager sends may all have completed already
        assert res["error"] is not None and "TransferCancelled" in res["error"]
    assert settle(pool, start) == start


def test_a_prefill_that_gives_up_fails_the_reservation_at_once(make_pool, rx, tx0):
    """Its prefill failed: the sender says so (proving the secret), and the reservation
    fails as given up, not at its lease (which would say timeout); a give-up without the
    secret changes nothing."""
    pool = make_pool([SPEC], num_pages=32, fail_grace_s=30.0)
    start = counters(pool)
    rx("rx_start", pool.spec.name, timeout_s=60.0)
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0)
    d, other = reserve(rx), reserve(rx)
    forged = dataclasses.replace(other, secret=secrets.token_bytes(len(other.secret)))
    tx0("tx_give_up", forged.to_bytes())
    tx0("tx_give_up", d.to_bytes())
    state, completed, expected, error = rx("rx_wait", d.slot, d.generation)
    assert state == FAILED and error == PREFILL_FAILED and completed == 0
    assert pool.poll(d.slot, d.generation).reason == "the prefill side gave the request up (its prefill failed or " \
                                                     "was aborted)"
    assert pool.poll(other.slot, other.generation).state == RESERVED
    rx("rx_cancel", other.slot, other.generation)
    assert settle(pool, start) == start


def test_a_dropped_sender_times_the_reservation_out(make_pool, rx, tx0):
    pool = make_pool([SPEC], num_pages=32, fail_grace_s=30.0)
    start = counters(pool)
    rx("rx_start", pool.spec.name, timeout_s=0.5)
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0, faults="drop_sender=1")
    d = reserve(rx)
    [res] = tx0("tx_run", [(d.to_bytes(), list(range(8)))], context=False, wait_s=10)
    assert "drop_sender" in res["error"] and res["sent"] < res["total"]
    state, completed, expected, error = rx("rx_wait", d.slot, d.generation)
    assert state == FAILED and error == TIMEOUT and completed < expected
    assert settle(pool, start) == start
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0)      # the session's sender, without faults


def _listening(pid: int) -> set[str]:
    """IPv4/IPv6 addresses process ``pid`` listens on (TCP)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:   # LISTEN
                    addr = cols[1].split(":")[0]
                    out.add(str(ipaddress.ip_address(bytes.fromhex(addr)[::-1]))
                            if len(addr) == 8 else addr)
    return out


def test_ucx_listens_on_loopback_unless_told_otherwise(make_pool, fresh_peers):
    pool = make_pool([SPEC], num_pages=8)
    rx = fresh_peers("kv-transfer-listening")
    rx("rx_start", pool.spec.name)
    assert _listening(rx.pid) == {"127.0.0.1"}
    rx("rx_start", pool.spec.name, net_devices="all")     # UCX's own choice: every interface
    everywhere = _listening(rx.pid)
    assert "127.0.0.1" in everywhere
    if everywhere == {"127.0.0.1"}:
        pytest.skip("this host has no network interface but loopback")
