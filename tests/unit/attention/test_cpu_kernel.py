"""The C++ paged-attention kernel (backends/attention/cpu_kernel.py): when it serves a
plan, its scalar path (a head_dim the SIMD path does not take), and the switch that
turns the CPU kernels off. Its maths against naive attention: test_attention.py, run on both paths."""

import pytest
import torch

from tandem.backends import cpu_kernels
from tandem.backends.attention import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    cpu_kernel,
)
from tandem.backends.attention.torch_ref import TorchBatchDecodeWrapper, TorchBatchPrefillWrapper


def pages_for(kv_lens, page_size):
    counts = [-(-n // page_size) for n in kv_lens]
    indptr = torch.tensor([0] + counts).cumsum(0).int()
    indices = torch.randperm(sum(counts) + 4, generator=torch.Generator().manual_seed(3))[: sum(counts)].int()
    last = torch.tensor([n - (c - 1) * page_size for n, c in zip(kv_lens, counts)]).int()
    return indptr, indices, last


def plan_of(wrapper):
    impl = getattr(wrapper, "_impl", wrapper)
    return impl._plan


def test_the_kernel_builds_on_this_machine():
    assert cpu_kernel.load()


def test_decode_and_short_verify_plans_use_the_kernel_and_long_prefills_do_not():
    indptr, indices, last = pages_for([40, 7], 16)
    decode = BatchDecodeWithPagedKVCacheWrapper(torch.empty(0), "HND")
    decode.plan(indptr, indices, last, 8, 2, 16, 16)
    assert plan_of(decode).kernel and not plan_of(decode).groups

    prefill = BatchPrefillWithPagedKVCacheWrapper(torch.empty(0), "HND")
    short = torch.tensor([0, cpu_kernel.MAX_QO_LEN, cpu_kernel.MAX_QO_LEN + 4]).int()
    prefill.plan(short, indptr, indices, last, 8, 2, 16, 16, causal=True)
    assert plan_of(prefill).kernel

    long_indptr, long_indices, long_last = pages_for([40, 40], 16)
    long = torch.tensor([0, cpu_kernel.MAX_QO_LEN + 1, cpu_kernel.MAX_QO_LEN + 2]).int()
    prefill.plan(long, long_indptr, long_indices, long_last, 8, 2, 16, 16, causal=True)
    assert not plan_of(prefill).kernel and plan_of(prefill).groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [36, 64, 96, 128])   # 36: no whole SIMD row, the scalar loops
def test_kernel_equals_the_torch_path(head_dim, dtype, monkeypatch):
    """Decode rows and causal verify rows (3 per request) over scattered pages."""
    gen = torch.Generator().manual_seed(head_dim)
    kv_lens, page_size, hq, hkv = [33, 5, 70], 8, 6, 2
    indptr, indices, last = pages_for(kv_lens, page_size)
    cache = torch.randn(int(indices.max()) + 1, 2, hkv, page_size, head_dim, generator=gen).to(dtype)
    results = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(cpu_kernel, "MAX_QO_LEN", 0)
        decode = TorchBatchDecodeWrapper(None, "HND")
        decode.plan(indptr, indices, last, hq, hkv, head_dim, page_size)
        verify = TorchBatchPrefillWrapper(None, "HND")
        qo_indptr = torch.tensor([0, 3, 6, 9]).int()
        verify.plan(qo_indptr, indptr, indices, last, hq, hkv, head_dim, page_size, causal=True)
        assert decode._plan.kernel == (path == "kernel") == verify._plan.kernel
        q = torch.randn(9, hq, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
        results[path] = (decode.run(q[:3], cache), verify.run(q, cache))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for kernel_out, torch_out in zip(*results.values()):
        torch.testing.assert_close(kernel_out.float(), torch_out.float(), **tol)


@pytest.mark.parametrize("value, attention, linear", [
    ("0", False, False), ("none", False, False), ("attention", True, False), ("linear", False, True),
    ("attention,linear", True, True), ("all", True, True)])
def test_tandem_cpu_kernels_selects_the_kernels(monkeypatch, value, attention, linear):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", value)
    assert (cpu_kernels.enabled("attention"), cpu_kernels.enabled("linear")) == (attention, linear)
    assert cpu_kernel.load() is attention


def test_without_a_compiler_the_kernels_stay_off(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cxx_compiler", lambda: None)
    assert cpu_kernels._built.__wrapped__() is False


def test_an_unknown_kernel_name_is_refused():
    with pytest.raises(ValueError, match="unknown CPU kernel 'flash'"):
        cpu_kernels.load("flash")


def test_ninja_is_found_beside_the_interpreter_when_path_lacks_it(monkeypatch, tmp_path):
    """torch's builder runs ninja from PATH; a venv's bin (where the ninja package puts
    it) need not be on PATH when the tests or servers run as .venv/bin/python."""
    import shutil
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    cpu_kernels._put_ninja_on_path()
    assert shutil.which("ninja") is not None
