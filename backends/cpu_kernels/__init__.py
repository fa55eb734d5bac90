"""The project's C++ CPU kernels, built on first use with the machine's compiler.

- ``paged_attention.cpp``: attention over paged K/V for few query rows per request
  (decode, verification), reading the pages in place (attention/cpu_kernel.py).
- ``small_m_linear.cpp``: a bf16 linear for 1 to 8 rows with AVX512-BF16 dot products,
  streaming the weight once (models/packed_linear.py); oneDNN's kernel reads it at about
  half the memory's bandwidth at these shapes.
- ``lora_sgmv.cpp``: a layer's LoRA deltas for a batch mixing adapters in one call
  (lora/ops.py), where torch spends a matmul pair, a gather and a scatter per adapter.
- ``shm_all_reduce.cpp``: a tensor-parallel group's all-reduce through shared memory
  (parallel/group.py), where gloo's TCP path costs a millisecond per call.

They go into one library built with ``-march=native`` into ``$TANDEM_KERNEL_CACHE_DIR``
(else ``~/.cache/tandem/kernels``), named by this CPU's flags, torch's version and the
sources, so later processes load it and another CPU never runs it. Without a compiler,
or with ``TANDEM_CPU_KERNELS=0``, :func:`load` returns False and the callers keep their
torch paths, which compute the same maths. ``TANDEM_CPU_KERNELS=attention`` (or
``linear``, ``lora``, ``all_reduce``, or a comma list) keeps those, for before/after measurements.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cpp", "small_m_linear.cpp",
                                                                   "lora_sgmv.cpp", "shm_all_reduce.cpp"))
# a kernel's name (TANDEM_CPU_KERNELS) -> the op that tells it registered
KERNELS = {"attention": "paged_attention", "linear": "small_m_linear", "lora": "lora_sgmv_",
           "all_reduce": "shm_all_reduce_"}


def cxx_compiler() -> str | None:
    """``$CXX``, else g++ or c++, or None when the machine has none (inductor builds the
    compiled decode step with the same one, engine/config.py)."""
    return shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")


def enabled(kernel: str) -> bool:
    """Whether ``TANDEM_CPU_KERNELS`` (default: all) lets ``kernel`` run."""
    value = os.environ.get("TANDEM_CPU_KERNELS", "all").strip().lower()
    if value in ("0", "none", "off", "false", ""):
        return False
    return value in ("1", "all", "on", "true") or kernel in value.split(",")


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_KERNEL_CACHE_DIR") or Path.home() / ".cache" / "tandem" / "kernels"
    return Path(root)


def _build_key() -> str:
    import torch
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        pass
    text = f"{platform.machine()} {flags} {torch.__version__} " + "".join(s.read_text() for s in SOURCES)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH. Every process must run the same
    one: ninja 1.12 changed the command hash in ``.ninja_log``, so a process with another
    ninja first on its PATH (the system's 1.11 against the ``ninja`` package's 1.13: a shell
    without the virtualenv's bin, and the Triton stubs with it) sees every command changed
    and rebuilds the library (10-16 s on 2 cores, in a server's first request). So the
    ``ninja`` package's (a dependency) goes first whenever it is installed."""
    try:
        import ninja
        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        if shutil.which("ninja") is not None:
            return
        bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + path


@functools.cache
def _built() -> bool:
    if cxx_compiler() is None:
        log.warning("no C++ compiler: the CPU kernels stay off (attention gathers pages, "
                    "linears run on oneDNN alone)")
        return False
    from torch.utils import cpp_extension
    _put_ninja_on_path()
    name = f"tandem_cpu_kernels_{_build_key()}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(build),
                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as err:   # a broken toolchain must not stop serving: the torch paths work
        log.warning("the CPU kernels did not build (%s): the torch paths run instead", err)
        return False
    return True


def load(kernel: str) -> bool:
    """Build or load the library once per process; True when ``kernel`` (one of
    :data:`KERNELS`) may run and ``torch.ops.tandem_cpu`` has it."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown CPU kernel {kernel!r}; known: {', '.join(KERNELS)}")
    return enabled(kernel) and _registered(KERNELS[kernel])


@functools.cache
def _registered(op: str) -> bool:
    """Whether the library built and registered ``op`` (small_m_linear only where the
    CPU has AVX512-BF16). Once per process: attention plans ask at every step."""
    if not _built():
        return False
    import torch
    return hasattr(torch.ops.tandem_cpu, op)
