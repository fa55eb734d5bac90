"""KV transfer between real processes over UCX on loopback: a receiver host
(kv_transfer), sender ranks (prefill), and this test process as the decoder that
maps the shared pool, watches the counters, claims and checks every byte."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from tandem.rdma import DestinationDescriptor, ModelSpec
from tandem.rdma.shared_pool import READY

from .peers import data_tag, expected_dst_page, full_kv, payload, wait_for

SRC_PAGES = 160


def models(layout: str, page_size: int):
    """A target and a draft model (the draft's KV travels in the same reservation)."""
    return (ModelSpec("target", 3, 4, 8, page_size, "bfloat16", layout),
            ModelSpec("draft", 2, 2, 8, page_size, "bfloat16", layout))


class CounterWatch:
    """Samples every reservation's counter while a transfer runs: it must never pass
    the expected count."""

    def __init__(self, pool, descs):
        self.pool, self.descs, self.over = pool, descs, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.001):
            for d in self.descs:
                st = self.pool.poll(d.slot, d.generation)
                if st.completed > d.expected_ops:
                    self.over.append((d.slot, st.completed))

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.over


def check_pages(pool, desc, src_pages, seed=0):
    for i, spec in enumerate(desc.models):
        full = full_kv(spec, SRC_PAGES, seed + i)
        got = pool.kv(0, spec.name).reshape(spec.num_layers, pool.spec.num_pages, -1)
        heads = (0, spec.num_kv_heads)
        for k, page in enumerate(desc.page_ids):
            np.testing.assert_array_equal(
                got[:, page], expected_dst_page(full, spec.kv_layout, src_pages[k], heads),
                err_msg=f"{spec.name} page {k} of reservation {desc.slot}")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("max_run_pages", [1, 8])
def test_many_requests_at_once_arrive_bit_exact(layout, page_size, max_run_pages, make_pool,
                                                rx, tx0):
    ms = models(layout, page_size)
    pool = make_pool(ms, num_pages=200, context_bytes=64)
    start = pool.stats()
    rx("rx_start", pool.spec.name)
    tx0("tx_start", ms, SRC_PAGES, rank=0, seed=0)
    lengths = [1, 2, page_size, 3 * page_size + 1, 40, 2 * page_size - 1]
    descs = [DestinationDescriptor.from_bytes(
        rx("rx_reserve", n, context_nbytes=(16, 24), max_run_pages=max_run_pages, seed=i))
        for i, n in enumerate(lengths)]
    rng = np.random.default_rng(page_size)
    free = list(range(SRC_PAGES))
    src_pages = []
    for i, d in enumerate(descs):   # half the requests from consecutive, half scattered pages
        n = len(d.page_ids)
        take = free[:n] if i % 2 == 0 else [int(p) for p in rng.choice(free, n, replace=False)]
        free = [p for p in free if p not in take]
        src_pages.append(take)
    watch = CounterWatch(pool, descs)
    try:
        results = tx0("tx_run", [(d.to_bytes(), s) for d, s in zip(descs, src_pages)],
                      chunk_tokens=7)
        for d in descs:
            state, completed, expected, _ = rx("rx_wait", d.slot, d.generation)
            assert state == READY and completed == expected == d.expected_ops
    finally:
        assert watch.stop() == []
    assert all(r["error"] is None and r["completed"] == r["total"] for r in results)
    assert sum(r["sent"] for r in results) == sum(d.expected_ops for d in descs)
    for d, s in zip(descs, src_pages):
        check_pages(pool, d, s)
        ctx = pool.context(d.slot)
        assert (ctx[:16] == 1).all() and (ctx[16:40] == 2).all()
        pool.free(pool.claim(d.slot, d.generation))   # the decoder takes the pages, then ends
    now = pool.stats()
    assert (now.free, now.reserved, now.in_use) == (start.free, start.reserved, start.in_use)
    assert tx0("tx_state")["freed"] == [len(s) for s in src_pages]   # prefill freed every page
    sent = tx0("tx_state")["stats"]
    assert sent["failed"] == 0 and sent["ops_completed"] == sum(d.expected_ops for d in descs)


def test_duplicates_and_malformed_messages_never_move_the_counter(make_pool, rx, tx1):
    spec = ModelSpec("target", 2, 2, 4, 2, "float32", "HND")
    pool = make_pool([spec], num_pages=8)
    address = rx("rx_start", pool.spec.name)
    # 2 pages x 2 layers, one op each
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 3, max_run_pages=1))
    page = spec.page_bytes(2)
    tx1("raw_start")
    tx1("raw_open", address, d.to_bytes())
    wait_for(lambda: rx("rx_stats")["handshakes"] >= 1)
    tag = lambda op, key=d.tag_key: data_tag(key, op)
    first = [(tag(0), payload(page, 7)), (tag(0), payload(page, 9)),   # op 0 twice
             (tag(1), payload(page - 1, 5)),                           # wrong length
             (tag(99), payload(page, 5)),                              # no such op
             (tag(1, d.tag_key ^ 1), payload(page, 5)),                # another key
             ((5 << 60) | 1, payload(8, 5))]                           # unknown kind
    assert tx1("raw_send", address, first) == ["ok"] * len(first)
    state, completed, expected, _ = rx("rx_wait", d.slot, d.generation, wait_s=0.3)
    assert (completed, expected) == (1, 4)
    rest = [(tag(op), payload(page, 7)) for op in (1, 2, 3)] + [(tag(3), payload(page, 1))]
    assert tx1("raw_send", address, rest) == ["ok"] * len(rest)
    state, completed, expected, _ = rx("rx_wait", d.slot, d.generation)
    assert state == READY and completed == expected == 4
    stats = rx("rx_stats")
    assert stats["dropped_duplicate"] >= 1 and stats["dropped_malformed"] == 3
    # the last duplicate arrives after READY, when the reservation is no longer live
    assert stats["dropped_stale"] + stats["dropped_duplicate"] == 3
    kv = pool.kv(0, "target").reshape(2, 8, -1)
    assert (kv[:, list(d.page_ids)] == 7).all()   # the first copy of op 0 won
    tx1("reset")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_engine_page_pools_on_both_sides(layout, make_pool):
    """The engine's own KVPagePool as the source and a KVPagePool over the shared pool
    as the destination: what attention reads on decode is what prefill wrote."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)   # the host's two cores are shared
    from tandem.backends.disagg.kv_views import shared_page_pool, source_pool
    from tandem.backends.kv_cache import KVPagePool
    from tandem.rdma import KVReceiver, KVSender

    src = KVPagePool(4, 12, 2, 4, 8, torch.bfloat16, layout)
    src.kv.copy_(torch.randn(src.kv.shape, dtype=torch.float32).to(torch.bfloat16))
    spec = ModelSpec("target", 4, 2, 8, 4, "bfloat16", layout)
    pool = make_pool([spec], num_pages=16)
    rx, tx = KVReceiver(pool), KVSender({"target": source_pool("target", src)})
    try:
        d = rx.reserve(10, max_run_pages=2)
        src_pages = [7, 2, 3]
        t = tx.begin(d, src_pages)
        step = tx.step("target", {t: 10})
        for layer in range(4):
            step.layer_done(layer)
        t.wait(10)
        assert rx.wait(d.slot, d.generation, 10).ready
        dst = shared_page_pool(pool, 0, "target")
        for s, p in zip(src_pages, d.page_ids):
            assert torch.equal(dst.kv[:, p], src.kv[:, s])
        pool.free(pool.claim(d.slot, d.generation))
    finally:
        rx.close()
        tx.close()
