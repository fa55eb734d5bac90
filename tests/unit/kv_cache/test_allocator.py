"""Page allocator invariants under random alloc/free sequences."""
import pytest
from hypothesis import given, settings, strategies as st

from tandem.backends.kv_cache import (KVAllocator, OutOfPages, PageAllocator, build_page_table,
                                      pages_needed)

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 12)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 32), ops=ops)
def test_random_sequences_never_hand_out_a_page_twice(num_pages, ops):
    a = PageAllocator(num_pages)
    owners: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            if n > a.num_free:
                with pytest.raises(OutOfPages):
                    a.alloc(n)
            else:
                owners.append(a.alloc(n))
        elif op == "free" and owners:
            a.free(owners.pop(n % len(owners)))
        # the invariants a user relies on, after every operation
        held = [p for pages in owners for p in pages]
        assert len(held) == len(set(held)) == a.num_used
        assert a.num_free + a.num_used == num_pages
    for pages in owners:
        a.free(pages)
    assert a.num_free == num_pages             # no leak once every owner is done


def test_the_engine_allocator_meets_the_scheduler_protocol():
    assert isinstance(PageAllocator(2), KVAllocator)


def test_double_free_and_bad_ids_are_refused():
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(ValueError, match="double free"):
        a.free(pages)
    with pytest.raises(ValueError, match="out of range"):
        a.free([9])


def test_a_page_listed_twice_is_refused_whole():
    a = PageAllocator(2)
    p, _ = a.alloc(2)
    with pytest.raises(ValueError, match="twice"):
        a.free([p, p])
    assert a.num_free == 0


def test_failed_alloc_takes_nothing():
    a = PageAllocator(3)
    a.alloc(2)
    with pytest.raises(OutOfPages):
        a.alloc(2)
    assert a.num_free == 1


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_page_table_lists_only_used_pages(page_size):
    lens = [1, page_size, page_size + 1, 3 * page_size]
    pages = [list(range(10 * i, 10 * i + pages_needed(n, page_size) + 1)) for i, n in enumerate(lens)]
    t = build_page_table(pages, lens, page_size)
    counts = [pages_needed(n, page_size) for n in lens]
    assert t.kv_indptr.tolist() == [0] + [sum(counts[:i + 1]) for i in range(len(lens))]
    assert t.kv_indices.tolist() == [p for ps, c in zip(pages, counts) for p in ps[:c]]
    assert all(1 <= x <= page_size for x in t.kv_last_page_len.tolist())
    assert [(c - 1) * page_size + l for c, l in zip(counts, t.kv_last_page_len.tolist())] == lens
