"""The caching allocator's invariants under random use, and the key chain."""
import pytest
from hypothesis import given, settings, strategies as st

from tandem.backends.kv_cache import KVAllocator, OutOfPages
from tandem.backends.kv_cache.page_hash import page_keys, root_key
from tandem.backends.kv_cache.prefix_cache import CachingAllocator

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "publish", "match", "reset"]),
                         st.integers(0, 12)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(1, 24), ops=ops)
def test_a_held_page_is_never_handed_out_evicted_or_renamed(num_pages, ops):
    """``content[p]``: what the page holds (its key once published). A matched page must
    hold what its key says; a held page must never be handed out again."""
    a = CachingAllocator(num_pages)
    owners: list[list[int]] = []
    content: dict[int, bytes] = {}
    keys = [bytes([i]) * 4 for i in range(6)]
    for op, n in ops:
        held = [p for pages in owners for p in pages]
        if op == "alloc":
            if n > a.num_free:
                with pytest.raises(OutOfPages):
                    a.alloc(n)
            else:
                got = a.alloc(n)
                assert not set(got) & set(held)
                for p in got:
                    content[p] = b"new"       # a fresh owner writes it
                owners.append(got)
        elif op == "free" and owners:
            a.free(owners.pop(n % len(owners)))
        elif op == "publish" and held:
            p, k = held[n % len(held)], keys[n % len(keys)]
            if content[p] == b"new" and a.publish(p, k):
                content[p] = k
        elif op == "match":
            chain = keys[:n % (len(keys) + 1)]
            got = a.match(chain)
            assert [content[p] for p in got] == chain[:len(got)]
            owners.append(got)
        elif op == "reset":
            a.reset()
            assert a.num_cached == 0
        counted = [p for pages in owners for p in pages]
        assert a.num_used == len(set(counted))
        assert all(a.ref_count(p) == counted.count(p) for p in set(counted))
        assert a.num_free + a.num_used == num_pages
    for pages in owners:
        a.free(pages)
    assert a.num_free == num_pages


def test_it_meets_the_scheduler_protocol():
    assert isinstance(CachingAllocator(2), KVAllocator)


def test_eviction_takes_never_cached_pages_first_then_the_least_recently_used():
    a = CachingAllocator(4)
    first, second = a.alloc(1), a.alloc(1)
    a.publish(first[0], b"a"), a.publish(second[0], b"b")
    a.free(first), a.free(second)        # "a" is the older
    assert a.alloc(2) and a.num_cached == 2 and a.stats.evictions == 0
    assert a.match([b"a"]) == first      # "a" is now the newer
    a.free(first)
    a.alloc(1)
    assert a.lookup([b"a"]) == 1 and a.lookup([b"b"]) == 0 and a.stats.evictions == 1


def test_a_sequence_frees_its_last_pages_first():
    """Its first pages are the ones other prompts share: they are evicted last."""
    a = CachingAllocator(3)
    pages = a.alloc(3)
    for p, k in zip(pages, (b"0", b"1", b"2")):
        a.publish(p, k)
    a.free(pages)
    a.alloc(1)
    assert a.lookup([b"0", b"1", b"2"]) == 2


def test_publishing_a_key_twice_keeps_the_first_page():
    a = CachingAllocator(2)
    p, q = a.alloc(2)
    assert a.publish(p, b"k") and not a.publish(q, b"k")
    a.free([p, q])
    assert a.match([b"k"]) == [p]


def test_withdraw_spares_pages_others_hold():
    a = CachingAllocator(2)
    p, q = a.alloc(2)
    a.publish(p, b"p"), a.publish(q, b"q")
    assert a.match([b"p"]) == [p]                # someone else holds p too
    assert a.withdraw([p, q]) == 1 and a.lookup([b"p"]) == 1 and a.lookup([b"q"]) == 0


def test_freeing_what_is_not_held_is_refused():
    a = CachingAllocator(2)
    with pytest.raises(ValueError, match="double free"):
        a.free([0])
    with pytest.raises(ValueError, match="only a held page"):
        a.publish(1, b"k")


def test_keys_chain_over_every_token_before_and_the_extra_keys():
    root = root_key("fp", "1", None)
    base = page_keys(list(range(12)), 4, root)
    assert len(base) == 3 and len(set(base)) == 3
    changed = page_keys([99] + list(range(1, 12)), 4, root)
    assert all(x != y for x, y in zip(base, changed))      # an early token changes them all
    assert page_keys(list(range(12)), 4, root, base[:2]) == base
    assert page_keys(list(range(12)), 4, root_key("fp", "2", None))[0] != base[0]
    assert page_keys(list(range(12)), 4, root_key("fp", "1", ""))[0] != base[0]
    # with one token of lookahead a page needs the token after it
    assert len(page_keys(list(range(12)), 4, root, lookahead=1)) == 2
