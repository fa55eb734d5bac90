"""Prefill TP != decode TP, with ranks as separate processes: each decode rank's pages
are rebuilt from head ranges of the prefill ranks bit for bit, the counter expects the
operations of both schemes, and with replicated KV every source replica sends."""
from __future__ import annotations

import numpy as np
import pytest

from tandem.rdma import DestinationDescriptor, ModelSpec, ShardScheme
from tandem.rdma.plan import ops_per_page
from tandem.rdma.shared_pool import READY

from .peers import expected_dst_page, full_kv

SRC_PAGES = 24
CASES = {
    "2->1": ((2, 1), (1, 1)),
    "1->2": ((1, 1), (2, 1)),
    "2->4": ((2, 1), (4, 1)),
    "replicated 2->2": ((2, 2), (2, 2)),
    "replicated 2->4": ((2, 2), (4, 4)),
}


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_transfer_rebuilds_every_decode_rank(case, layout, make_pool, rx, tx0, tx1):
    src, dst = (ShardScheme(*s) for s in CASES[case])
    spec = ModelSpec("target", 2, 8, 8, 4, "bfloat16", layout)
    pool = make_pool([spec], num_pages=32, scheme=dst, context_bytes=16)
    rx("rx_start", pool.spec.name)
    senders = [tx0, tx1][:src.tp_size]
    for rank, tx in enumerate(senders):
        tx("tx_start", [spec], SRC_PAGES, rank=rank, scheme=(src.tp_size, src.replica_sets))
    d = DestinationDescriptor.from_bytes(
        rx("rx_reserve", 18, src=(src.tp_size, src.replica_sets), context_nbytes=(16,),
           max_run_pages=4, seed=1))
    src_pages = [20, 3, 4, 5, 11]
    for tx in senders:
        tx.send("tx_run", [(d.to_bytes(), src_pages)], chunk_tokens=8)
    results = [tx.result() for tx in senders]
    state, completed, expected, _ = rx("rx_wait", d.slot, d.generation)
    assert state == READY and completed == expected
    assert all(r[0]["error"] is None for r in results)
    assert sum(r[0]["sent"] for r in results) == expected
    if src.replica_sets > 1:
        assert all(r[0]["sent"] > 0 for r in results), "every source replica sends"
    # the expected count follows from both schemes alone
    unit_ops = ops_per_page(spec, src, dst)
    whole_pages = unit_ops == dst.tp_size   # one op per destination rank: runs coalesce
    if not whole_pages:
        assert expected == len(d.page_ids) * spec.num_layers * unit_ops + 1
    full = full_kv(spec, SRC_PAGES, seed=0)
    for rank in range(dst.tp_size):
        heads = dst.head_range(rank, spec.num_kv_heads)
        got = pool.kv(rank, "target").reshape(spec.num_layers, 32, -1)
        for k, page in enumerate(d.page_ids):
            np.testing.assert_array_equal(
                got[:, page], expected_dst_page(full, layout, src_pages[k], heads),
                err_msg=f"decode rank {rank}, page {k}")
    assert (pool.context(d.slot) == 1).all()
    pool.free(pool.claim(d.slot, d.generation))
    assert pool.stats().free == 32


def test_a_rank_with_nothing_to_send_opens_nothing(make_pool, rx, tx0, tx1):
    """Replicated KV (each prefill rank holds every head) into one decode rank: one
    replica set sends, here rank 0's (KV and context). Rank 1 has nothing to send, so
    its transfer ends at once without an Open, which could otherwise reach the receiver
    after the reservation was complete and be refused, failing the request."""
    from tandem.rdma.plan import assign_replica_sets
    src, dst = ShardScheme(2, 2), ShardScheme(1)
    seed = next(s for s in range(64) if assign_replica_sets(src, dst, s) == [0])
    spec = ModelSpec("target", 2, 8, 8, 4, "bfloat16", "HND")
    pool = make_pool([spec], num_pages=32, scheme=dst, context_bytes=16)
    rx("rx_start", pool.spec.name)
    for rank, tx in enumerate((tx0, tx1)):
        tx("tx_start", [spec], SRC_PAGES, rank=rank, scheme=(2, 2))
    handshakes = rx("rx_stats")["handshakes"]
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 18, src=(2, 2), context_nbytes=(16,), seed=seed))
    for tx in (tx0, tx1):
        tx.send("tx_run", [(d.to_bytes(), [20, 3, 4, 5, 11])], chunk_tokens=8)
    sender, idle = (tx.result()[0] for tx in (tx0, tx1))
    assert sender["error"] is None and idle["error"] is None
    assert (idle["total"], idle["sent"]) == (0, 0) and sender["sent"] == sender["total"] > 0
    state, completed, expected, _ = rx("rx_wait", d.slot, d.generation)
    assert state == READY and completed == expected
    assert rx("rx_stats")["handshakes"] - handshakes == 1, "the idle rank opened the transfer"
    pool.free(pool.claim(d.slot, d.generation))
