"""The prefill service with its prefix cache, over real UCX (a receiver and a
:class:`PrefillService` in this process, each with its own worker): the KV landing in
decode's pages is the same with the prefill cache cold and warm, cached pages are sent
before any forward runs, only the pages decode lacks travel (``first_page``), a failed
transfer leaves nothing cached, salts isolate."""
from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
import time

import pytest
import torch

from tandem.backends.disagg import PrefillService, context_nbytes, decode_pool_spec
from tandem.backends.disagg.kv_views import shared_page_pool
from tandem.backends.engine import EngineConfig
from tandem.backends.kv_cache.page_hash import page_keys, root_key
from tandem.rdma import KVReceiver, SenderConfig, SharedKVPool

from ...rdma.pool_helpers import cache_hold
from ..kv_reference import spec_for, token_kv

PAGE = 4
_names = itertools.count()


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


BASE = tokens(22, 1)      # prefills 21 tokens: 6 pages, 5 full ones short of the last token
OTHER = tokens(13, 2)


class Side:
    """A decode pool with its receiver, and a prefill service feeding it."""

    def __init__(self, model_dir, spec=None, kv_layout="HND", prefill_pages=32):
        name = f"tkv-ppc-{os.getpid()}-{next(_names)}"
        SharedKVPool.unlink_stale(name)
        pool_spec = dataclasses.replace(
            decode_pool_spec(name, model_dir, "float32", PAGE, kv_layout, 64, speculative=spec),
            max_pins=8)
        self.pool = SharedKVPool.create(pool_spec)
        self.rx = KVReceiver(self.pool)
        self.svc = PrefillService(
            EngineConfig(model_dir, dtype="float32", page_size=PAGE, kv_layout=kv_layout,
                         num_pages=prefill_pages, max_num_batched_tokens=8, speculative=spec),
            SenderConfig(timeout_s=10.0))
        self.svc.start()
        self.ctx = context_nbytes(model_dir, "float32")
        self.names = [m.name for m in pool_spec.models]

    def reserve(self, prompt, cached_keys=(), max_run_pages=None):
        return self.rx.reserve(len(prompt) - 1, context_nbytes=(self.ctx,),
                               cached_keys=cached_keys, max_run_pages=max_run_pages)

    def submit(self, desc, prompt, salt=None) -> queue.Queue:
        ended = queue.Queue()
        self.svc.submit(desc, prompt, ended.put, cache_salt=salt)
        return ended

    def received(self, desc, n):
        """{model: KV of the first n tokens} as the decoder reads it after claiming, and
        the context blob."""
        assert self.rx.wait(desc.slot, desc.generation, 30).ready
        pages = self.pool.claim(desc.slot, desc.generation)
        kv = {m: token_kv(shared_page_pool(self.pool, 0, m), pages, n).clone()
              for m in self.names}
        return kv, self.pool.context(desc.slot).copy(), pages

    def run(self, prompt, salt=None, cached_keys=()):
        d = self.reserve(prompt, cached_keys)
        assert self.submit(d, prompt, salt).get(timeout=60) is None
        return (d, *self.received(d, len(prompt) - 1))

    def hits(self) -> int:
        return self.svc.engine.prefix_cache_stats().hit_tokens

    def close(self):
        self.svc.shutdown()
        self.rx.close()
        self.pool.close(release=False)
        self.pool.unlink()


@pytest.fixture
def side(target_dir, random_mtp_dir):
    made = []

    def make(method=None, **kw):
        s = Side(str(target_dir), spec_for(method, target_dir, random_mtp_dir), **kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def assert_kv_equal(got, want, exact_tokens):
    """The first ``exact_tokens`` bit for bit (the same prefill pages sent twice), the
    rest as recomputed."""
    for m in want:
        assert torch.equal(got[m][:, :, :exact_tokens], want[m][:, :, :exact_tokens]), m
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method,kv_layout", [(None, "HND"), (None, "NHD"),
                                              ("draft_target", "HND"), ("mtp", "NHD")])
def test_decode_receives_the_same_kv_from_a_cold_and_a_warm_prefill_cache(side, method,
                                                                           kv_layout):
    s = side(method, kv_layout=kv_layout)
    _, cold, cold_ctx, _ = s.run(BASE)
    assert s.hits() == 0
    _, warm, warm_ctx, _ = s.run(BASE)
    assert s.hits() == 20
    assert_kv_equal(warm, cold, 20)
    torch.testing.assert_close(torch.from_numpy(warm_ctx).view(torch.float32),
                               torch.from_numpy(cold_ctx).view(torch.float32),
                               rtol=1e-5, atol=1e-6)
    _, some, _, _ = s.run(BASE[:10] + OTHER)   # two pages from the cache
    assert s.hits() == 28
    _, alone, _, _ = side(method, kv_layout=kv_layout).run(BASE[:10] + OTHER)
    assert_kv_equal(some, alone, 0)
    assert s.svc.engine.allocator.num_free == s.svc.engine.allocator.num_pages


def test_cached_pages_are_sent_before_any_forward(side, monkeypatch):
    s = side("draft_target")
    _, cold, _, _ = s.run(BASE)
    gate = threading.Event()
    forward = s.svc.engine.runner.forward

    def gated(batch, on_layer_done=None):
        assert gate.wait(30)
        return forward(batch, on_layer_done)
    monkeypatch.setattr(s.svc.engine.runner, "forward", gated)
    d = s.reserve(BASE, max_run_pages=1)      # one operation per page: a cached one is ready alone
    ended = s.submit(d, BASE)
    try:
        dst = {m: shared_page_pool(s.pool, 0, m) for m in s.names}
        deadline = time.monotonic() + 15
        while not all(torch.equal(token_kv(dst[m], d.page_ids, 20), cold[m][:, :, :20])
                      for m in s.names):
            assert time.monotonic() < deadline, "the cached pages never arrived"
            time.sleep(0.01)
    finally:
        gate.set()
    assert ended.get(timeout=60) is None
    warm, _, _ = s.received(d, len(BASE) - 1)
    assert_kv_equal(warm, cold, 20)


@pytest.mark.parametrize("decode_pages,prefill_warm", [(2, False), (2, True), (5, False),
                                                       (5, True)])
def test_only_the_pages_decode_lacks_are_sent(side, decode_pages, prefill_warm):
    """Decode's cache holds the first ``decode_pages`` pages: the descriptor starts at
    ``first_page`` and the prefill — whatever its own cache holds — sends the rest; the
    decoder's page table (shared pages, then received ones) holds the whole prompt's KV."""
    s = side("mtp")
    ref_side = side("mtp")
    _, ref, ref_ctx, ref_pages = ref_side.run(BASE)
    if prefill_warm:
        s.run(BASE)
    root = root_key("decode-test")
    s.pool.become_cache_owner(root)
    held = s.pool.alloc(decode_pages)
    cache_hold(s.pool, held)
    for m in s.names:   # decode computed these pages once: the same KV as the reference's
        shared_page_pool(s.pool, 0, m).kv[:, held] = \
            shared_page_pool(ref_side.pool, 0, m).kv[:, ref_pages[:decode_pages]]
    keys = page_keys(BASE, PAGE, root)
    for p, k in zip(held, keys):
        assert s.pool.cache_publish(p, k)
    s.pool.cache_free(held)                     # cached, evictable, until a reservation pins them
    sent_before = s.svc.sender.stats.bytes_sent
    d, got, ctx, pages = s.run(BASE, cached_keys=keys)
    assert d.first_page == decode_pages and len(d.page_ids) == 6 - decode_pages
    assert pages[:decode_pages] == held
    assert s.hits() == (20 if prefill_warm else 0)
    # only the pages decode lacked, every layer of the target and the MTP head
    page_bytes = sum(p.page_bytes * p.num_layers
                     for p in (s.svc.engine.pool, s.svc.engine.proposer.pool))
    assert s.svc.sender.stats.bytes_sent - sent_before == \
        (6 - decode_pages) * page_bytes + s.ctx
    assert_kv_equal(got, ref, 20 if prefill_warm else decode_pages * PAGE)
    torch.testing.assert_close(torch.from_numpy(ctx).view(torch.float32),
                               torch.from_numpy(ref_ctx).view(torch.float32))


def test_a_failed_transfer_leaves_nothing_cached(side):
    s = side()
    d = s.reserve(BASE)
    s.rx.cancel(d.slot, d.generation)           # the request went away: the Open is refused
    error = s.submit(d, BASE).get(timeout=60)
    assert error is not None
    eng = s.svc.engine
    assert eng.allocator.num_cached == 0 and eng.allocator.num_free == eng.allocator.num_pages
    s.run(BASE)
    assert s.hits() == 0 and eng.allocator.num_cached == 5


def test_salts_isolate(side):
    s = side()
    s.run(BASE, salt="tenant-a")
    s.run(BASE, salt="tenant-b")
    s.run(BASE)
    assert s.hits() == 0
    s.run(BASE, salt="tenant-a")
    assert s.hits() == 20
