"""tandem.backends.attention against naive per-request softmax attention.

Pages are scattered at random over a cache whose unused slots hold random
values, so any gather or masking mistake shows up in the output. Every test runs
twice on the CPU: with the C++ kernel for few query rows (backends/attention/
cpu_kernel.py) and with the torch path alone, which serves long prefills anyway.
"""

import doctest
import math
import sys
import types
import zlib

import pytest
import torch

from tandem.backends import attention
from tandem.backends.attention import cpu_kernel
from tandem.backends.attention import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    append_paged_kv_cache,
    append_slots,
    get_batch_indices_positions,
)

LAYOUTS = ["NHD", "HND"]
PAGE_SIZES = [1, 5, 16]
DTYPES = [torch.float32, torch.bfloat16]
HEADS = [(4, 4), (8, 2), (6, 1)]  # (num_qo_heads, num_kv_heads): MHA, GQA 4, MQA
HEAD_DIM = 16
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny shapes: a second intra-op thread only adds spin-waits (and stalls when cores are busy)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def attention_path(request, monkeypatch):
    if request.param == "kernel":
        assert cpu_kernel.load(), "the C++ paged attention did not build (a C++ compiler is installed)"
    else:
        monkeypatch.setattr(cpu_kernel, "MAX_QO_LEN", 0)
    return request.param


def workspace():
    return torch.empty(0, dtype=torch.uint8)


# ---- plain helpers --------------------------------------------------------------------------


def slot_view(cache, kv_layout, kv, page, slot):
    """The [num_kv_heads, head_dim] slot of one token (kv: 0 = K, 1 = V)."""
    part = cache[kv] if isinstance(cache, tuple) else cache[:, kv]
    return part[page, slot] if kv_layout == "NHD" else part[page, :, slot]


def new_cache(num_pages, page_size, num_kv_heads, kv_layout, dtype, gen, as_tuple=False):
    inner = (page_size, num_kv_heads) if kv_layout == "NHD" else (num_kv_heads, page_size)
    if as_tuple:
        return tuple(torch.randn(num_pages, *inner, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    return torch.randn(num_pages, 2, *inner, HEAD_DIM, generator=gen).to(dtype)


def paged_batch(kv_lens, page_size, num_kv_heads, kv_layout, dtype, gen, as_tuple=False):
    """Random K/V per request, written token by token into randomly chosen pages."""
    pages_per = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_per) + 3  # spare pages stay garbage
    kv_indices = torch.randperm(num_pages, generator=gen)[: sum(pages_per)].int()
    kv_indptr = torch.tensor([0] + pages_per).cumsum(0).int()
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages_per)]).int()
    cache = new_cache(num_pages, page_size, num_kv_heads, kv_layout, dtype, gen, as_tuple)
    keys, values = [], []
    for b, n in enumerate(kv_lens):
        k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        for t in range(n):
            page = int(kv_indices[int(kv_indptr[b]) + t // page_size])
            slot_view(cache, kv_layout, 0, page, t % page_size).copy_(k[t])
            slot_view(cache, kv_layout, 1, page, t % page_size).copy_(v[t])
        keys.append(k)
        values.append(v)
    return cache, kv_indptr, kv_indices, last, keys, values


def naive_attention(q, k, v, causal, scale):
    """q [qo, Hq, D], k/v [kv, Hkv, D] -> [qo, Hq, D] in float64."""
    qo, num_qo_heads, _ = q.shape
    kv, num_kv_heads, _ = k.shape
    group = num_qo_heads // num_kv_heads
    out = torch.empty(qo, num_qo_heads, q.shape[-1], dtype=torch.float64)
    i = torch.arange(qo)[:, None]
    j = torch.arange(kv)[None, :]
    for h in range(num_qo_heads):
        scores = q[:, h].double() @ k[:, h // group].double().T * scale
        if causal:
            scores = scores.masked_fill(j > i + (kv - qo), float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group].double()
    return out


# ---- prefill --------------------------------------------------------------------------------

PREFILL_CASES = {
    # name: (qo_lens, kv_lens, causal)
    "qo_eq_kv": ([23], [23], True),
    "qo_eq_kv_batch": ([20, 20], [20, 20], True),
    "qo_lt_kv": ([5, 12], [37, 50], True),
    "verify_uniform": ([4, 4, 4], [40, 40, 40], True),
    "mixed": ([96, 1, 3, 0, 33], [130, 7, 64, 9, 33], True),
    "non_causal": ([5, 12], [37, 50], False),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_prefill_matches_naive(kv_layout, page_size, dtype, heads, case):
    qo_lens, kv_lens, causal = PREFILL_CASES[case]
    num_qo_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kv_layout}{page_size}{case}".encode()))
    cache, kv_indptr, kv_indices, last, keys, values = paged_batch(
        kv_lens, page_size, num_kv_heads, kv_layout, dtype, gen
    )
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).int()
    q = torch.randn(sum(qo_lens), num_qo_heads, HEAD_DIM, generator=gen).to(dtype)

    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, num_qo_heads, num_kv_heads, HEAD_DIM,
                 page_size, causal=causal, q_data_type=dtype)
    out = wrapper.run(q, cache)

    assert out.shape == q.shape and out.dtype == dtype
    for b, (qo, start) in enumerate(zip(qo_lens, qo_indptr.tolist())):
        expected = naive_attention(q[start:start + qo], keys[b], values[b], causal, HEAD_DIM**-0.5)
        torch.testing.assert_close(out[start:start + qo].double(), expected, **TOL[dtype])


def test_prefill_runs_per_layer_and_custom_scale():
    """One plan serves several layers (caches); sm_scale is honoured; out= is filled."""
    gen = torch.Generator().manual_seed(1)
    qo_lens, kv_lens = [3, 1, 40], [10, 4, 90]
    layers = [paged_batch(kv_lens, 16, 2, "HND", torch.float32, gen) for _ in range(2)]
    # both layers share one page table, as in the engine
    kv_indptr, kv_indices, last = layers[0][1:4]
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).int()
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(), "HND")
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, 8, 2, HEAD_DIM, 16, causal=True, sm_scale=0.3)
    for _, _, _, _, keys, values in layers:
        cache = torch.zeros(int(kv_indices.max()) + 1, 2, 2, 16, HEAD_DIM)
        for b, n in enumerate(kv_lens):
            for t in range(n):
                page = int(kv_indices[int(kv_indptr[b]) + t // 16])
                cache[page, 0, :, t % 16] = keys[b][t]
                cache[page, 1, :, t % 16] = values[b][t]
        q = torch.randn(sum(qo_lens), 8, HEAD_DIM, generator=gen)
        out = torch.full_like(q, float("nan"))
        assert wrapper.run(q, cache, out=out) is out
        for b, start in enumerate(qo_indptr[:-1].tolist()):
            expected = naive_attention(q[start:start + qo_lens[b]], keys[b], values[b], True, 0.3)
            torch.testing.assert_close(out[start:start + qo_lens[b]].double(), expected, atol=1e-5, rtol=1e-5)


# ---- decode ---------------------------------------------------------------------------------

DECODE_KV_LENS = {"single": [37], "uniform": [48, 48, 48, 48], "ragged": [1, 17, 33, 100, 5, 16]}


@pytest.mark.parametrize("kv_lens", list(DECODE_KV_LENS))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_decode_matches_naive(kv_layout, page_size, dtype, heads, kv_lens):
    kv_lens = DECODE_KV_LENS[kv_lens]
    num_qo_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(len(kv_lens) * 100 + page_size)
    cache, kv_indptr, kv_indices, last, keys, values = paged_batch(
        kv_lens, page_size, num_kv_heads, kv_layout, dtype, gen
    )
    q = torch.randn(len(kv_lens), num_qo_heads, HEAD_DIM, generator=gen).to(dtype)

    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout)
    wrapper.plan(kv_indptr, kv_indices, last, num_qo_heads, num_kv_heads, HEAD_DIM, page_size,
                 q_data_type=dtype)
    out = wrapper.run(q, cache)

    assert out.shape == q.shape and out.dtype == dtype
    for b in range(len(kv_lens)):
        expected = naive_attention(q[b:b + 1], keys[b], values[b], False, HEAD_DIM**-0.5)
        torch.testing.assert_close(out[b:b + 1].double(), expected, **TOL[dtype])


@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_decode_accepts_k_v_tuple(kv_layout):
    gen = torch.Generator().manual_seed(7)
    kv_lens = [9, 30]
    cache, kv_indptr, kv_indices, last, keys, values = paged_batch(
        kv_lens, 4, 2, kv_layout, torch.float32, gen, as_tuple=True
    )
    q = torch.randn(2, 4, HEAD_DIM, generator=gen)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout)
    wrapper.plan(kv_indptr, kv_indices, last, 4, 2, HEAD_DIM, 4)
    out = wrapper.run(q, cache)
    for b in range(2):
        expected = naive_attention(q[b:b + 1], keys[b], values[b], False, HEAD_DIM**-0.5)
        torch.testing.assert_close(out[b:b + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wrapper_kind", ["decode", "prefill"])
def test_q_sliced_from_fused_qkv_and_out_buffer(wrapper_kind):
    """q as the engine has it: a strided slice of a fused qkv projection."""
    gen = torch.Generator().manual_seed(11)
    kv_lens = [20, 7, 33]
    cache, kv_indptr, kv_indices, last, keys, values = paged_batch(kv_lens, 5, 2, "NHD", torch.float32, gen)
    qkv = torch.randn(3, (8 + 2 * 2) * HEAD_DIM, generator=gen)
    q = qkv[:, : 8 * HEAD_DIM].view(3, 8, HEAD_DIM)
    assert not q.is_contiguous()
    if wrapper_kind == "decode":
        wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
        wrapper.plan(kv_indptr, kv_indices, last, 8, 2, HEAD_DIM, 5)
    else:
        wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
        wrapper.plan(torch.arange(4).int(), kv_indptr, kv_indices, last, 8, 2, HEAD_DIM, 5, causal=True)
    out = torch.full((3, 8, HEAD_DIM), float("nan"))
    assert wrapper.run(q, cache, out=out) is out
    for b in range(3):
        expected = naive_attention(q[b:b + 1], keys[b], values[b], True, HEAD_DIM**-0.5)
        torch.testing.assert_close(out[b:b + 1].double(), expected, atol=1e-5, rtol=1e-5)


# ---- append ---------------------------------------------------------------------------------


def plain_positions(append_lens, seq_lens):
    batch, pos = [], []
    for b, (n, total) in enumerate(zip(append_lens, seq_lens)):
        batch += [b] * n
        pos += list(range(total - n, total))
    return batch, pos


def test_get_batch_indices_positions_flashinfer_example():
    batch, pos = get_batch_indices_positions(torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32),
                                             torch.tensor([5, 5, 5, 5], dtype=torch.int32), 10)
    assert batch.dtype == pos.dtype == torch.int32
    assert batch.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]


def test_get_batch_indices_positions_with_empty_requests_and_out_buffers():
    append_lens, seq_lens = [0, 3, 0, 2, 1], [4, 3, 8, 19, 1]
    indptr = torch.tensor([0] + append_lens).cumsum(0).int()
    out_b, out_p = torch.empty(6, dtype=torch.int32), torch.empty(6, dtype=torch.int32)
    batch, pos = get_batch_indices_positions(indptr, torch.tensor(seq_lens).int(), 6, out_b, out_p)
    assert batch is out_b and pos is out_p
    assert (batch.tolist(), pos.tolist()) == plain_positions(append_lens, seq_lens)


@pytest.mark.parametrize("precomputed", [False, True, "rows"], ids=["slots", "given-slots", "given-rows"])
@pytest.mark.parametrize("as_tuple", [False, True], ids=["5d", "tuple"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_append_writes_exactly_the_new_slots(kv_layout, page_size, as_tuple, precomputed):
    gen = torch.Generator().manual_seed(page_size)
    old_lens, append_lens = [0, 5, 16, 3, 7], [3, 12, 1, 0, 17]  # spills across page boundaries
    seq_lens = [a + b for a, b in zip(old_lens, append_lens)]
    pages_per = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_per) + 4
    kv_indices = torch.randperm(num_pages, generator=gen)[: sum(pages_per)].int()
    kv_indptr = torch.tensor([0] + pages_per).cumsum(0).int()
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(seq_lens, pages_per)]).int()
    cache = new_cache(num_pages, page_size, 2, kv_layout, torch.float32, gen, as_tuple)
    expected = tuple(c.clone() for c in cache) if as_tuple else cache.clone()

    nnz = sum(append_lens)
    k = torch.randn(nnz, 2, HEAD_DIM, generator=gen)
    v = torch.randn(nnz, 2, HEAD_DIM, generator=gen)
    append_indptr = torch.tensor([0] + append_lens).cumsum(0).int()
    batch, pos = get_batch_indices_positions(append_indptr, torch.tensor(seq_lens).int(), nnz)
    # the engine computes the slots once per step (append_slots) and passes them to every layer
    # (with the layout and heads, also the rows of a 5-D cache: the one-copy path)
    geometry = (kv_layout, 2) if precomputed == "rows" else ()
    slots = append_slots(batch, pos, kv_indices, kv_indptr, page_size, *geometry) if precomputed else None
    append_paged_kv_cache(k, v, batch, pos, cache, kv_indices, kv_indptr, last, kv_layout=kv_layout,
                          slots=slots)

    for t, (b, p) in enumerate(zip(*plain_positions(append_lens, seq_lens))):
        page = int(kv_indices[int(kv_indptr[b]) + p // page_size])
        slot_view(expected, kv_layout, 0, page, p % page_size).copy_(k[t])
        slot_view(expected, kv_layout, 1, page, p % page_size).copy_(v[t])
    for got, want in zip(cache if as_tuple else (cache,), expected if as_tuple else (expected,)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_append_then_attend_round_trip(kv_layout):
    """Chunked prefill then two decode steps, all through append + wrappers, as the engine does."""
    gen = torch.Generator().manual_seed(3)
    page_size, num_qo_heads, num_kv_heads, total = 5, 8, 2, [13, 7]
    pages_per = [math.ceil(n / page_size) for n in total]
    kv_indices = torch.randperm(sum(pages_per) + 2, generator=gen)[: sum(pages_per)].int()
    kv_indptr_full = torch.tensor([0] + pages_per).cumsum(0).int()
    cache = torch.zeros(sum(pages_per) + 2, 2, *((page_size, 2) if kv_layout == "NHD" else (2, page_size)), HEAD_DIM)
    keys = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in total]
    values = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in total]
    queries = [torch.randn(n, num_qo_heads, HEAD_DIM, generator=gen) for n in total]

    def step(lens_before, lens_after, wrapper_kind):
        # page table covering lens_after (pages are reserved up front, the table grows)
        used = [math.ceil(n / page_size) for n in lens_after]
        indptr = torch.tensor([0] + used).cumsum(0).int()
        indices = torch.cat([kv_indices[int(kv_indptr_full[b]):int(kv_indptr_full[b]) + used[b]] for b in range(2)])
        last = torch.tensor([n - (u - 1) * page_size for n, u in zip(lens_after, used)]).int()
        new = [(a, b) for a, b in zip(lens_before, lens_after)]
        qo_indptr = torch.tensor([0] + [b - a for a, b in new]).cumsum(0).int()
        k = torch.cat([keys[r][a:b] for r, (a, b) in enumerate(new)])
        v = torch.cat([values[r][a:b] for r, (a, b) in enumerate(new)])
        q = torch.cat([queries[r][a:b] for r, (a, b) in enumerate(new)])
        batch, pos = get_batch_indices_positions(qo_indptr, torch.tensor(lens_after).int(), q.shape[0])
        append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr, last, kv_layout)
        if wrapper_kind == "prefill":
            w = BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout)
            w.plan(qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads, HEAD_DIM, page_size, causal=True)
        else:
            w = BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout)
            w.plan(indptr, indices, last, num_qo_heads, num_kv_heads, HEAD_DIM, page_size)
        out = w.run(q, cache)
        for r, (a, b) in enumerate(new):
            expected = naive_attention(queries[r][a:b], keys[r][:b], values[r][:b], True, HEAD_DIM**-0.5)
            got = out[int(qo_indptr[r]):int(qo_indptr[r + 1])]
            torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)

    step([0, 0], [6, 4], "prefill")  # first chunk of request 0, whole prompt of request 1
    step([6, 4], [11, 5], "prefill")  # second chunk beside a decode token: a mixed batch
    step([11, 5], [12, 6], "decode")
    step([12, 6], [13, 7], "decode")


# ---- errors and dispatch --------------------------------------------------------------------


def test_plan_rejects_bad_indices():
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    with pytest.raises(ValueError, match="kv_last_page_len"):
        wrapper.plan(torch.tensor([0, 1]).int(), torch.tensor([0]).int(), torch.tensor([17]).int(), 4, 2, 16, 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        wrapper.plan(torch.tensor([0, 1]).int(), torch.tensor([0]).int(), torch.tensor([3]).int(), 3, 2, 16, 16)
    prefill = BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    with pytest.raises(ValueError, match="qo_len <= kv_len"):
        prefill.plan(torch.tensor([0, 4]).int(), torch.tensor([0, 1]).int(), torch.tensor([0]).int(),
                     torch.tensor([3]).int(), 2, 2, 16, 16, causal=True)
    with pytest.raises(ValueError, match="kv_layout"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(), "NDH")
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        wrapper.plan(torch.tensor([0, 1]).int(), torch.tensor([0]).int(), torch.tensor([3]).int(),
                     2, 2, 16, 16, logits_soft_cap=30.0)


def test_run_rejects_mismatched_inputs():
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    cache = torch.zeros(2, 2, 16, 2, 16)
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(torch.zeros(1, 2, 16), cache)
    wrapper.plan(torch.tensor([0, 1]).int(), torch.tensor([0]).int(), torch.tensor([3]).int(), 2, 2, 16, 16)
    with pytest.raises(ValueError, match="q must be"):
        wrapper.run(torch.zeros(2, 2, 16), cache)
    with pytest.raises(ValueError, match="to match the plan"):
        wrapper.run(torch.zeros(1, 2, 16), torch.zeros(2, 2, 8, 2, 16))


def test_cuda_tensors_delegate_to_flashinfer(monkeypatch):
    """With CUDA tensors every call goes to flashinfer unchanged (a stand-in module records them)."""
    calls = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            calls.append(("init", type(self).__name__, args, kwargs))

        def plan(self, *args, **kwargs):
            calls.append(("plan", args, kwargs))

        def run(self, *args, **kwargs):
            calls.append(("run", args, kwargs))
            return "flashinfer-out"

    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=type("Prefill", (Recorder,), {}),
        BatchDecodeWithPagedKVCacheWrapper=type("Decode", (Recorder,), {}),
        append_paged_kv_cache=lambda *a, **k: calls.append(("append", a, k)),
        get_batch_indices_positions=lambda *a, **k: calls.append(("positions", a, k)) or "fi-positions",
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(attention.flashinfer_impl, "wanted", lambda tensor: True)
    ws = workspace()

    prefill = BatchPrefillWithPagedKVCacheWrapper(ws, "HND", use_cuda_graph=False)
    prefill.plan("qo", "indptr", "indices", "last", 8, 2, 64, 16, causal=True, window_left=-1)
    assert prefill.run("q", "cache", out="o") == "flashinfer-out"
    decode = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    decode.plan("indptr", "indices", "last", 8, 2, 64, 16, sm_scale=0.1)
    decode.run("q", "cache")
    append_paged_kv_cache("k", "v", "b", "p", "cache", "indices", "indptr", "last", kv_layout="HND")
    assert get_batch_indices_positions(torch.zeros(2), "lens", 3) == "fi-positions"

    assert calls[0] == ("init", "Prefill", (ws, "HND"), {"use_cuda_graph": False})
    assert calls[1] == ("plan", ("qo", "indptr", "indices", "last", 8, 2, 64, 16),
                        {"causal": True, "sm_scale": None, "q_data_type": "float16", "kv_data_type": None,
                         "window_left": -1})
    assert calls[2] == ("run", ("q", "cache"), {"out": "o"})
    assert calls[3] == ("init", "Decode", (ws, "NHD"), {})
    assert calls[4] == ("plan", ("indptr", "indices", "last", 8, 2, 64, 16),
                        {"sm_scale": 0.1, "q_data_type": "float16", "kv_data_type": None})
    assert calls[5] == ("run", ("q", "cache"), {})
    assert calls[6] == ("append", ("k", "v", "b", "p", "cache", "indices", "indptr", "last"), {"kv_layout": "HND"})
    assert calls[7][0] == "positions" and calls[7][1][1:] == ("lens", 3, None, None)


def test_cpu_path_never_imports_flashinfer():
    test_decode_accepts_k_v_tuple("HND")
    assert "flashinfer" not in sys.modules


@pytest.mark.parametrize("module", ["", ".layout", ".batch_plan"])
def test_docstring_examples_run(module):
    mod = sys.modules[attention.__name__ + module]
    result = doctest.testmod(mod)
    assert result.failed == 0 and result.attempted > 0


def test_wrapper_moves_between_inference_mode_and_normal_mode():
    gen = torch.Generator().manual_seed(5)
    cache, kv_indptr, kv_indices, last, keys, values = paged_batch([9, 21], 4, 2, "HND", torch.float32, gen)
    q = torch.randn(2, 4, HEAD_DIM, generator=gen)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(), "HND")
    with torch.inference_mode():
        wrapper.plan(kv_indptr, kv_indices, last, 4, 2, HEAD_DIM, 4)
        inside = wrapper.run(q, cache)
    outside = wrapper.run(q, cache)
    wrapper.plan(kv_indptr, kv_indices, last, 4, 2, HEAD_DIM, 4)
    with torch.inference_mode():
        again = wrapper.run(q, cache)
    torch.testing.assert_close(inside, outside)
    torch.testing.assert_close(again, outside)
