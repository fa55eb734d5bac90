"""The shared pool's prefix cache: decode publishes and holds, kv_transfer (another
handle on the same files, as another process has) looks up and pins; eviction, claims,
failures and owner deaths never hand out a page somebody uses."""
from __future__ import annotations

import os
import random
import signal
import types
from collections import Counter

import numpy as np
import pytest

from tandem.rdma import PoolExhausted, PoolError, SharedKVPool
from tandem.rdma.plan import ModelSpec
from tandem.rdma.pool_keys import KeyTable
from tandem.rdma.pool_layout import H_DIRTY, H_FREE_TOP
from tandem.rdma.reservations import CANCELLED, READY

from .pool_helpers import cache_hold

MODEL = ModelSpec("target", 2, 2, 8, 4, "float32")
ROOT = bytes(range(16))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def pools(make_pool):
    """(decode, kv_transfer): two handles on one pool; decode owns the cache."""
    def make(num_pages=16, max_pins=8, **kw):
        dec = make_pool((MODEL,), num_pages, max_pins=max_pins, **kw)
        xfer = SharedKVPool.open(dec.spec.name)
        dec.become_cache_owner(ROOT)
        made.append(xfer)
        return dec, xfer
    made = []
    yield make
    for p in made:
        p.close(release=False)


def cache_pages(dec: SharedKVPool, n: int, first_key: int = 0) -> list[int]:
    """A decode sequence computes ``n`` pages, publishes them and ends."""
    pages = dec.alloc(n)
    cache_hold(dec, pages)
    for i, p in enumerate(pages):
        assert dec.cache_publish(p, key(first_key + i))
    dec.cache_free(pages)
    return pages


def test_freed_cached_pages_stay_findable_and_count_as_free(pools):
    dec, xfer = pools()
    pages = cache_pages(dec, 3)
    assert xfer.num_free == 16 and dec.cache_counts() == (3, 0)
    assert xfer.cache_root() == ROOT
    assert xfer.cache_lookup([key(0), key(1), key(9)]) == 2
    assert xfer.cache_lookup([key(1)]) == 1 and xfer.cache_lookup([key(5)]) == 0
    stats = dec.stats()     # evictable: free for any allocation, and still cached
    assert (stats.free, stats.in_use, stats.cached) == (16, 0, 3)
    del pages


def test_a_reservation_shares_the_cached_prefix_and_the_claim_hands_it_over(pools):
    dec, xfer = pools()
    cached = cache_pages(dec, 3)
    slot, gen, fresh, shared = xfer.reserve_prefix(5, [key(0), key(1), key(7)], 1, 30.0)
    assert shared == 2 and len(fresh) == 3 and not set(fresh) & set(cached)
    xfer.add_completed(slot)
    assert xfer.mark_ready(slot, gen, 30.0)
    got = dec.claim(slot, gen)
    assert got == cached[:2] + fresh
    cache_hold(dec, fresh)
    dec.cache_free(got)                 # the sequence ends: only the cached pages stay
    assert dec.num_free == 16 and dec.cache_counts()[0] == 3


def test_at_least_one_page_is_fresh_and_pins_are_capped(pools):
    dec, xfer = pools(max_pins=2)
    cache_pages(dec, 4)
    _, _, fresh, shared = xfer.reserve_prefix(4, [key(i) for i in range(4)], 1, 30.0)
    assert (shared, len(fresh)) == (2, 2)
    _, _, fresh, shared = xfer.reserve_prefix(2, [key(0), key(1)], 1, 30.0)
    assert (shared, len(fresh)) == (1, 1)


def test_pinned_and_held_pages_are_never_evicted(pools):
    dec, xfer = pools(num_pages=8)
    cached = cache_pages(dec, 4)            # 4 evictable
    held = dec.alloc(1)
    cache_hold(dec, held)
    assert dec.cache_publish(held[0], key(100))
    slot, gen, fresh, shared = xfer.reserve_prefix(3, [key(0), key(1)], 1, 30.0)
    assert shared == 2
    # 8 pages: 2 pinned, 1 held, 1 fresh, 2 cached evictable, 2 free
    assert dec.num_free == 4
    taken = dec.alloc(4)                    # evicts the two unpinned cached pages
    assert set(taken) >= set(cached[2:]) and not set(taken) & set(cached[:2] + held)
    assert dec.cache_counts() == (3, 2)
    with pytest.raises(PoolExhausted):
        dec.alloc(1)
    assert xfer.fail(slot, gen, CANCELLED)  # the pins end: the shared pages are evictable
    assert dec.num_free == 3 and xfer.cache_lookup([key(0), key(1)]) == 2


def test_eviction_takes_the_least_recently_freed_first(pools):
    dec, _ = pools(num_pages=6, max_pins=4)
    first = cache_pages(dec, 2, first_key=0)
    second = cache_pages(dec, 2, first_key=10)
    dec.alloc(2)                            # the two never-cached pages
    got = dec.alloc(2)
    assert sorted(got) == sorted(first) and dec.cache_lookup([key(10), key(11)]) == 2
    del second


def test_only_the_owner_publishes_and_a_key_is_cached_once(pools):
    dec, xfer = pools()
    pages = dec.alloc(2)
    cache_hold(dec, pages)
    assert dec.cache_publish(pages[0], key(1))
    assert not dec.cache_publish(pages[1], key(1))     # another sequence's copy stays private
    mine = xfer.alloc(1)
    assert not xfer.cache_publish(mine[0], key(2))      # kv_transfer never publishes
    with pytest.raises(ValueError, match="not held"):   # another process's page
        dec.cache_publish(mine[0], key(3))
    slot, gen, fresh, _ = xfer.reserve_prefix(1, [], 1, 30.0)
    with pytest.raises(ValueError, match="not held"):   # a reservation's, not yet claimed
        dec.cache_publish(fresh[0], key(4))


def test_drop_withdraws_only_pages_nobody_else_uses(pools):
    dec, xfer = pools()
    cache_pages(dec, 1, first_key=0)
    shared = dec.cache_match([key(0)])
    slot, gen, _, n = xfer.reserve_prefix(2, [key(0)], 1, 30.0)   # pinned too
    assert n == 1
    pages = dec.alloc(1)
    cache_hold(dec, pages)
    dec.cache_publish(pages[0], key(5))
    assert dec.cache_drop(shared + pages) == 1
    assert xfer.cache_lookup([key(5)]) == 0 and xfer.cache_lookup([key(0)]) == 1
    assert xfer.fail(slot, gen, CANCELLED)


def test_a_lookup_stays_right_after_evictions_and_page_reuse(pools):
    """Pages evicted and published again under other keys, round after round: every
    key is found on the page it is cached on now, by both processes, and an evicted
    key nowhere."""
    rng = random.Random(1)
    dec, xfer = pools(num_pages=6, max_pins=4)
    cached: dict[bytes, int] = {}          # what the cache must hold: key -> page
    for round_ in range(40):
        seq = dec.alloc(rng.randint(1, 6))     # evicts the least recently freed first
        evicted = {k for k, p in cached.items() if p in seq}
        cached = {k: p for k, p in cached.items() if k not in evicted}
        cache_hold(dec, seq)
        for p in rng.sample(seq, rng.randint(0, len(seq))):
            k = key(rng.choice([rng.randrange(12), 100 + round_]))
            if dec.cache_publish(p, k):
                assert k not in cached
                cached[k] = p
            else:
                assert k in cached      # a key is cached once; the page stays private
        dec.cache_free(seq)
        for k in (key(i) for i in [*range(12), *range(100, 101 + round_)]):
            want = [cached[k]] if k in cached else []
            assert xfer.cache_lookup([k]) == len(want)
            assert dec.cache_match([k]) == want
            dec.cache_free(want)
        assert dec.cache_counts()[0] == len(cached)
    assert dec.cache_counts()[1] > 20      # it evicted


def test_a_process_dying_mid_change_leaves_a_key_table_that_is_rebuilt(pools):
    dec, xfer = pools()
    cache_pages(dec, 3)
    dec._ctl.key_table[:] = 0        # torn half-way through a change: the flag stays set
    dec._ctl.hdr[H_DIRTY] = 1
    assert xfer.cache_lookup([key(0), key(1), key(2)]) == 3


@pytest.mark.parametrize("num_pages", [1, 5, 64])
@pytest.mark.parametrize("collide", [False, True])
def test_the_key_table_agrees_with_a_dict(num_pages, collide, monkeypatch):
    """Random inserts and removals, with every key hashing to one entry too (one run
    wrapping round the table): a key is found exactly while its page is indexed."""
    if collide:
        monkeypatch.setattr(KeyTable, "_home", lambda self, a, b, mask: mask)
    size = 1 << (2 * num_pages - 1).bit_length()
    ctl = types.SimpleNamespace(key_table=np.zeros(size, np.int32),
                                page_keys=np.zeros((num_pages, 2), np.uint64))
    table, rng, want = KeyTable(ctl), random.Random(num_pages), {}
    for _ in range(2000):
        page = rng.randrange(num_pages)
        if page in want.values():
            table.remove(page)
            want = {k: p for k, p in want.items() if p != page}
        else:
            k = (rng.randrange(1 << 64), rng.randrange(4))
            if k in want:
                continue
            ctl.page_keys[page] = k
            table.insert(page)
            want[k] = page
        assert sorted(ctl.key_table[ctl.key_table > 0] - 1) == sorted(want.values())
        for k, p in want.items():
            assert table.find(*k) == p
        assert table.find(rng.randrange(1 << 64), 9) == -1


def test_a_claim_of_shared_pages_by_another_process_is_refused(pools):
    dec, xfer = pools()
    cache_pages(dec, 1)
    slot, gen, _, _ = xfer.reserve_prefix(2, [key(0)], 1, 30.0)
    xfer.add_completed(slot)
    xfer.mark_ready(slot, gen, 30.0)
    with pytest.raises(PoolError, match="owner"):
        xfer.claim(slot, gen)
    assert xfer.poll(slot, gen).state == READY


def test_a_new_owner_drops_the_old_cache_and_fails_reservations_sharing_it(pools):
    dec, xfer = pools()
    cache_pages(dec, 2)
    slot, gen, _, shared = xfer.reserve_prefix(3, [key(0), key(1)], 1, 30.0)
    assert shared == 2
    new = SharedKVPool.open(dec.spec.name)
    try:
        new.become_cache_owner(bytes(16))
        assert xfer.poll(slot, gen).failed
        assert new.cache_counts()[0] == 0 and new.num_free == 16
    finally:
        new.close()


def test_the_owners_death_frees_its_cache_and_fails_the_sharers(pools):
    dec, xfer = pools()
    name = dec.spec.name
    pid = os.fork()
    if pid == 0:   # a decode that caches two pages and is killed
        try:
            child = SharedKVPool.open(name)
            child.become_cache_owner(ROOT)
            cache_pages(child, 2)
            os.write(1, b"")
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert xfer.cache_lookup([key(0), key(1)]) == 2
    slot, gen, _, shared = xfer.reserve_prefix(3, [key(0), key(1)], 1, 30.0)
    assert shared == 2
    assert xfer.reclaim_dead() == 1
    assert xfer.poll(slot, gen).failed
    assert xfer.cache_lookup([key(0)]) == 0 and xfer.num_free == 16
    assert xfer.cache_root() is None


def test_random_operations_keep_every_page_accounted_for(pools):
    """300 random sequences of decode and kv_transfer operations: after each, a page
    is in exactly one state, the free count is what the states say, nothing held or
    pinned was handed out, and a rebuild from the arrays derives the same counts."""
    rng = random.Random(0)
    dec, xfer = pools(num_pages=24, max_pins=6, headroom_pages=2)
    refs: Counter[int] = Counter()      # decode's holds, as its allocator counts them
    seqs: list[list[int]] = []
    live: dict[tuple[int, int], list[int]] = {}   # reservations: their fresh pages
    chain = [key(i) for i in range(1000, 1010)]   # one prompt's chain, cached page by page
    next_key = iter(range(10_000))
    shared_total = 0

    def take(pages):
        refs.update(pages)
        seqs.append(pages)

    for _ in range(300):
        op = rng.choices(["seq", "end", "publish", "reserve", "claim", "fail", "reset"],
                         [3, 3, 4, 2, 1, 1, 1])[0]
        try:
            if op == "seq":
                shared = dec.cache_match(chain[:rng.randint(0, 6)])
                try:
                    pages = dec.alloc(rng.randint(1, 3))
                except PoolExhausted:
                    dec.cache_free([p for p in shared if refs[p] == 0])
                    raise
                cache_hold(dec, pages)
                take(shared + pages)
            elif op == "end" and seqs:
                pages = seqs.pop(rng.randrange(len(seqs)))
                refs.subtract(pages)
                last = [p for p in pages if refs[p] == 0]
                if rng.random() < 0.3:
                    dec.cache_drop(last)
                dec.cache_free(last)
            elif op == "publish" and seqs:
                p = rng.choice(rng.choice(seqs))
                k = chain[dec.cache_lookup(chain)] if rng.random() < 0.8 and \
                    dec.cache_lookup(chain) < len(chain) else key(next(next_key))
                dec.cache_publish(p, k)
            elif op == "reserve":
                n = rng.randint(1, 5)
                slot, gen, fresh, shared = xfer.reserve_prefix(n, chain, 1, 30.0)
                assert len(fresh) + shared == n and shared <= min(n - 1, 6)
                live[slot, gen] = fresh
                shared_total += shared
            elif op == "claim" and live:
                (slot, gen) = rng.choice(sorted(live))
                xfer.add_completed(slot)
                xfer.mark_ready(slot, gen, 30.0)
                pages = dec.claim(slot, gen)
                assert pages[len(pages) - len(live[slot, gen]):] == live.pop((slot, gen))
                cache_hold(dec, pages)
                take(pages)
            elif op == "fail" and live:
                (slot, gen) = rng.choice(sorted(live))
                xfer.fail(slot, gen, CANCELLED)
                del live[slot, gen]
            elif op == "reset" and rng.random() < 0.1:
                dec.cache_reset()
        except PoolExhausted:
            pass
        _check(dec, [p for p, n in refs.items() if n > 0], live)
    assert shared_total > 20 and dec.cache_counts()[1] > 5   # it shared and evicted


def _check(pool: SharedKVPool, held: list[int], live) -> None:
    c = pool._ctl
    fresh = [p for pages in live.values() for p in pages]
    top = int(c.hdr[H_FREE_TOP])
    stack = set(c.free_stack[:top].tolist())
    assert len(stack) == top
    assert not stack & set(held) and not stack & set(fresh)
    assert not stack & set(np.flatnonzero(c.page_pins > 0).tolist())
    assert all(c.page_owner[p] == 0 for p in stack)
    assert not c.page_cached[sorted(stack)].any()
    assert all(c.page_held[p] for p in held)
    evictable = pool._cache._evictable_mask()
    assert not set(np.flatnonzero(evictable).tolist()) & set(held + fresh)
    assert pool.num_free == top + int(evictable.sum())
    pins = np.zeros_like(c.page_pins)
    for slot in np.flatnonzero(pool._slots.live()):
        np.add.at(pins, pool._cache.pinned(int(slot)), 1)
    assert (pins == c.page_pins).all()
    cached = np.flatnonzero(c.page_cached == 1)      # the key table indexes exactly these
    assert sorted(c.key_table[c.key_table > 0] - 1) == cached.tolist()
    assert all(pool._cache.find(c.page_keys[p].tobytes()) == p for p in cached)
    before = (pool.num_free, c.page_pins.copy(), c.key_table.copy())
    with pool._locked():
        pool._pages.rebuild(pool._slots.live())
    assert pool.num_free == before[0] and (c.page_pins == before[1]).all()
    assert sorted(c.key_table[c.key_table > 0]) == sorted(before[2][before[2] > 0])
