"""The C++ paged-attention kernel for few query rows per request (csrc/paged_attention.cpp).

It reads K and V in place from their pages; the pure-torch path gathers every page of
the batch into a padded copy per layer and masks it, which at 16 decode rows of a
30-layer model with ~400-token contexts was half the step (``tandem bench profile``).

Built on first use with the machine's C++ compiler (for this CPU: ``-march=native``)
into ``$TANDEM_KERNEL_CACHE_DIR``, else ``~/.cache/tandem/kernels``; later processes
load the built library. Without a compiler, or with ``TANDEM_CPU_ATTENTION=0`` (for
before/after measurements), :func:`load` returns False and attention stays on the
torch path, which computes the same maths.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from ..toolchain import cxx_compiler

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
# requests with more query rows than this go to the torch path: there a padded SDPA
# over a long chunk (prefill) runs as matrix products, which beat this kernel's loops
MAX_QO_LEN = 16


def enabled() -> bool:
    return os.environ.get("TANDEM_CPU_ATTENTION", "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_KERNEL_CACHE_DIR") or Path.home() / ".cache" / "tandem" / "kernels"
    return Path(root)


def _cpu_key() -> str:
    """The build's name carries the CPU and torch it was built for: -march=native code
    must not run on another CPU sharing the cache directory."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    text = f"{platform.machine()} {flags} {torch.__version__} {SOURCE.read_bytes().hex()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def load() -> bool:
    """Build or load the kernel once per process; True when ``torch.ops.tandem_cpu``
    has it."""
    if not enabled():
        return False
    if cxx_compiler() is None:
        log.warning("no C++ compiler: paged attention runs on the torch path (gathering pages)")
        return False
    from torch.utils import cpp_extension
    name = f"tandem_paged_attention_{_cpu_key()}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build),
                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as err:   # a broken toolchain must not stop serving: the torch path works
        log.warning("the C++ paged attention did not build (%s): attention runs on the torch path", err)
        return False
    return True


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, hnd: bool,
                    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_lens: torch.Tensor, num_kv_heads: int, causal: bool, sm_scale: float) -> torch.Tensor:
    """Attention of ragged ``q [nnz, Hq, D]`` over the pages of each request (FlashInfer's
    indptr conventions; ``kv_lens`` per request); int64 indices."""
    return torch.ops.tandem_cpu.paged_attention(q, k_cache, v_cache, hnd, qo_indptr, kv_indptr,
                                                 kv_indices, kv_lens, num_kv_heads, causal, sm_scale)
