"""Transfer plans, exhaustively and without processes: executing a plan's byte copies
rebuilds every destination rank's pages bit for bit, writes each byte exactly once,
and has exactly the operation count the receiver expects."""
from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tandem.rdma.descriptor
import tandem.rdma.plan
import tandem.rdma.shared_pool
import tandem.rdma.wire
from tandem.rdma.plan import (ModelSpec, ShardScheme, assign_replica_sets, layer_ops, ops_per_page,
                              page_pieces, page_runs, plan_transfer, shard_pairs)

from .peers import expected_dst_page, full_kv, rank_pool


@pytest.mark.parametrize("module", [tandem.rdma.plan, tandem.rdma.wire, tandem.rdma.descriptor,
                                    tandem.rdma.shared_pool])
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0


SCHEMES = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (4, 1)),
           ((4, 1), (2, 1)), ((2, 2), (2, 2)), ((2, 2), (4, 4)), ((4, 4), (2, 2)),
           ((4, 2), (2, 1)), ((2, 1), (4, 2))]


def execute(plan, spec_i, src_scheme, dst_scheme, full, src_pages, page_ids, p_src, p_dst):
    """Run one model's plan as byte copies, the way the sender addresses its memory
    (runs of scattered source pages are gathered page by page)."""
    spec = plan.models[spec_i]
    lo = plan.layer_ops[spec_i]
    h = spec.num_kv_heads
    srcs = [rank_pool(full, spec.kv_layout, src_scheme.head_range(r, h))
            for r in range(src_scheme.tp_size)]
    dsts = [np.zeros(spec.pool_bytes(dst_scheme.heads_per_rank(h), p_dst), np.uint8)
            for _ in range(dst_scheme.tp_size)]
    writes = [np.zeros_like(d, dtype=np.int32) for d in dsts]
    pb_s = spec.page_bytes(src_scheme.heads_per_rank(h))
    pb_d = spec.page_bytes(dst_scheme.heads_per_rank(h))
    for layer, row in itertools.product(range(spec.num_layers), range(len(lo))):
        s, d = int(lo.src_rank[row]), int(lo.dst_rank[row])
        first, npages, n = int(lo.first[row]), int(lo.npages[row]), int(lo.nbytes[row])
        if npages == 1:
            a = layer * p_src * pb_s + src_pages[first] * pb_s + int(lo.src_off[row])
            data = srcs[s][a:a + n]
        else:
            data = np.concatenate([srcs[s][layer * p_src * pb_s + p * pb_s:][:pb_s]
                                   for p in src_pages[first:first + npages]])
        b = layer * p_dst * pb_d + page_ids[first] * pb_d + int(lo.dst_off[row])
        dsts[d][b:b + n] = data
        writes[d][b:b + n] += 1
    return dsts, writes


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("max_run_pages", [1, 3])
@pytest.mark.parametrize("schemes", SCHEMES, ids=lambda s: f"{s[0]}->{s[1]}")
def test_plan_rebuilds_every_destination_rank_bit_exact(layout, page_size, max_run_pages, schemes):
    src, dst = ShardScheme(*schemes[0]), ShardScheme(*schemes[1])
    spec = ModelSpec("m", num_layers=2, num_kv_heads=8, head_dim=4, page_size=page_size,
                     dtype="bfloat16", kv_layout=layout)
    p_src, p_dst, num_tokens = 12, 16, 6 * page_size + 1   # last page partly filled
    rng = np.random.default_rng(0)
    page_ids = [3, 4, 5, 9, 10, 11, 0]               # runs and gaps
    src_pages = [int(p) for p in rng.permutation(p_src)[:7]]
    plan = plan_transfer((spec,), page_ids, num_tokens, src, dst, max_run_pages, (8,), seed=5)
    full = full_kv(spec, p_src, seed=1)
    dsts, writes = execute(plan, 0, src, dst, full, src_pages, page_ids, p_src, p_dst)
    for d in range(dst.tp_size):
        heads = dst.head_range(d, spec.num_kv_heads)
        got = dsts[d].reshape(spec.num_layers, p_dst, -1)
        w = writes[d].reshape(spec.num_layers, p_dst, -1)
        for i, page in enumerate(page_ids):
            np.testing.assert_array_equal(got[:, page],
                                          expected_dst_page(full, layout, src_pages[i], heads))
            assert (w[:, page] == 1).all(), "every byte of a destination page written exactly once"
        untouched = np.setdiff1d(np.arange(p_dst), page_ids)
        assert (w[:, untouched] == 0).all()
    assert plan.num_ops == plan.num_kv_ops + 1


@pytest.mark.parametrize("schemes", SCHEMES, ids=lambda s: f"{s[0]}->{s[1]}")
def test_every_destination_rank_is_fed_and_every_chosen_source_sends(schemes):
    src, dst = ShardScheme(*schemes[0]), ShardScheme(*schemes[1])
    pairs = shard_pairs(src, dst, num_kv_heads=8, seed=3)
    # each destination rank gets each of its heads from exactly one source rank
    for d in range(dst.tp_size):
        lo, hi = dst.head_range(d, 8)
        got = sorted(h for p in pairs if p.dst_rank == d for h in range(*p.heads))
        assert got == list(range(lo, hi))
    if dst.replica_sets >= src.replica_sets:
        assert {p.src_rank for p in pairs} == set(range(src.tp_size)), "every source sends"


def test_replica_assignment_is_seeded_and_balanced():
    src, dst = ShardScheme(4, 4), ShardScheme(8, 8)
    a = assign_replica_sets(src, dst, seed=1)
    assert a == assign_replica_sets(src, dst, seed=1)
    assert sorted(a) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({tuple(assign_replica_sets(src, dst, seed=s)) for s in range(20)}) > 1


@pytest.mark.parametrize("layout,schemes,per_page", [
    ("HND", ((1, 1), (1, 1)), 1), ("NHD", ((1, 1), (1, 1)), 1),
    ("HND", ((2, 1), (2, 1)), 2),          # matched TP: each rank pair moves whole pages
    ("HND", ((2, 1), (1, 1)), 4),          # K and V halves from each of 2 sources
    ("HND", ((1, 1), (2, 1)), 4),
    ("NHD", ((2, 1), (1, 1)), 2 * 2 * 16),  # one op per token per K/V per source
    ("NHD", ((1, 1), (4, 1)), 4 * 2 * 16),
    ("HND", ((2, 2), (2, 2)), 2),           # replicated: each destination rank, whole pages
])
def test_operations_per_page(layout, schemes, per_page):
    spec = ModelSpec("m", 32, 8, 128, 16, "bfloat16", layout)
    assert ops_per_page(spec, ShardScheme(*schemes[0]), ShardScheme(*schemes[1])) == per_page


def test_expected_count_is_pages_times_layers_times_shards_plus_context():
    spec = ModelSpec("m", 5, 8, 16, 4, "float16", "HND")
    pages = [7, 1, 2, 40]
    for src, dst in [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (4, 1))]:
        s, d = ShardScheme(*src), ShardScheme(*dst)
        plan = plan_transfer((spec,), pages, 14, s, d, max_run_pages=1, context_nbytes=(10, 20))
        assert plan.num_ops == len(pages) * spec.num_layers * ops_per_page(spec, s, d) + 2


def test_whole_page_runs_follow_destination_contiguity():
    spec = ModelSpec("m", 1, 2, 4, 2, "float32")
    lo = layer_ops(spec, [5, 6, 7, 8, 2, 3], ShardScheme(1), ShardScheme(1), max_run_pages=3)
    assert list(zip(lo.first.tolist(), lo.npages.tolist())) == [(0, 3), (3, 1), (4, 2)]
    page = spec.page_bytes(2)
    assert lo.nbytes.tolist() == [3 * page, page, 2 * page]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 30), min_size=1, max_size=40, unique=True),
       cap=st.integers(1, 6))
def test_page_runs_partition_the_sequence(ids, cap):
    runs = page_runs(ids, cap)
    assert [i for f, n in runs for i in range(f, f + n)] == list(range(len(ids)))
    for f, n in runs:
        assert 1 <= n <= cap
        assert ids[f:f + n] == list(range(ids[f], ids[f] + n))
    for (f, n), (g, _) in zip(runs, runs[1:]):
        if n < cap:   # maximal: a run stops early only where the ids break
            assert ids[g] != ids[f + n - 1] + 1


@settings(max_examples=60, deadline=None)
@given(n_tokens=st.integers(1, 40), ps=st.sampled_from([1, 3, 8]), run=st.integers(1, 5),
       layers=st.lists(st.integers(1, 4), min_size=1, max_size=3), ctx=st.integers(0, 3))
def test_locate_inverts_op_index(n_tokens, ps, run, layers, ctx):
    models = [ModelSpec(f"m{i}", n, 4, 8, ps, "bfloat16", "NHD" if i % 2 else "HND")
              for i, n in enumerate(layers)]
    n_pages = -(-n_tokens // ps)
    plan = plan_transfer(models, list(range(100, 100 + n_pages)), n_tokens, ShardScheme(2),
                         ShardScheme(1), run, tuple(range(1, ctx + 1)))
    seen = set()
    for m, spec in enumerate(models):
        for layer in range(spec.num_layers):
            for row in range(len(plan.layer_ops[m])):
                op = plan.op_index(m, layer, row)
                ref = plan.locate(op)
                assert (ref.model, ref.layer, ref.row) == (m, layer, row)
                seen.add(op)
    for i in range(ctx):
        assert plan.locate(plan.context_op(i)).row == i
        seen.add(plan.context_op(i))
    assert seen == set(range(plan.num_ops))
    with pytest.raises(IndexError):
        plan.locate(plan.num_ops)


@pytest.mark.parametrize("bad", [dict(tp_size=0), dict(tp_size=4, replica_sets=3)])
def test_bad_shard_scheme_says_what_is_allowed(bad):
    with pytest.raises(ValueError, match="replica_sets"):
        ShardScheme(**bad)


def test_heads_must_split_evenly():
    with pytest.raises(ValueError, match="cannot be split"):
        ShardScheme(3).head_range(0, num_kv_heads=8)


def test_pieces_are_contiguous_in_both_layouts():
    # HND: a 4-head slice of an 8-head page is its K half-slice and its V half-slice
    p = page_pieces("HND", (0, 8), (4, 8), (4, 8), page_size=16, head_dim=128, itemsize=2)
    blk = 4 * 16 * 128 * 2
    assert [(x.src_off, x.dst_off, x.nbytes) for x in p] == [(blk, 0, blk), (3 * blk, blk, blk)]
    # NHD: one row of 4 heads per token, K then V
    p = page_pieces("NHD", (0, 8), (4, 8), (4, 8), page_size=2, head_dim=128, itemsize=2)
    row = 4 * 128 * 2
    assert [(x.src_off, x.dst_off) for x in p] == [(row, 0), (3 * row, row), (5 * row, 2 * row),
                                                   (7 * row, 3 * row)]


@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
def test_layout_names_and_page_count_are_the_backends(page_size):
    """rdma holds its own copy (it imports nothing of tandem): the same names in the
    same order (the wire's layout code) and the same page count."""
    from tandem.backends.kv_cache import pages

    assert tandem.rdma.plan.KV_LAYOUTS == pages.KV_LAYOUTS
    assert all(tandem.rdma.plan.pages_needed(n, page_size) == pages.pages_needed(n, page_size)
               for n in range(4 * page_size + 2))
