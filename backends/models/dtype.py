"""``dtype="auto"``: bf16 only where the hardware computes it natively, fp32 otherwise.

On a CPU without AVX512-BF16 or AMX, torch's bf16 matmuls are emulated: measured on an
AVX2-only EPYC, bf16 GEMM ran at 0.9 GFLOPS against fp32's 58, so a bf16 prefill there
is many times slower than fp32 although its weights are half the bytes. CUDA GPUs
compute bf16 natively. Torch-free: the Triton models that only size pages read it too.

>>> resolve_dtype("auto", "cpu", flags={"avx2", "avx512_bf16"})
DtypeChoice(dtype='bfloat16', reason='auto: the CPU has avx512_bf16')
>>> resolve_dtype("auto", "cpu", flags={"avx2"}).dtype
'float32'
>>> resolve_dtype("float16", "cpu").reason
'asked for'
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

AUTO = "auto"
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")   # /proc/cpuinfo's names


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str      # float32 | bfloat16 | float16
    reason: str     # why, for the start-up log and /metrics


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first ``flags`` line of a ``/proc/cpuinfo`` text.

    >>> sorted(parse_cpu_flags("processor : 0\\nflags : fpu avx2 avx512_bf16\\n"))
    ['avx2', 'avx512_bf16', 'fpu']
    """
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def resolve_dtype(dtype: str, device: str = "cpu", flags: frozenset[str] | set[str] | None = None) -> DtypeChoice:
    """The dtype to run: ``dtype`` itself unless it is ``"auto"``."""
    if dtype != AUTO:
        return DtypeChoice(dtype, "asked for")
    if device.startswith("cuda"):
        return DtypeChoice("bfloat16", "auto: CUDA computes bf16 natively")
    have = [f for f in NATIVE_BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if have:
        return DtypeChoice("bfloat16", f"auto: the CPU has {have[0]}")
    return DtypeChoice("float32", "auto: the CPU has no native bf16 (" + " or ".join(NATIVE_BF16_FLAGS)
                       + "); emulated bf16 is many times slower than fp32")
