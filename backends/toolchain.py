"""The machine's C++ compiler: inductor builds the compiled decode step's kernels with
it (engine/config.py), and the CPU paged-attention kernel is built with it
(attention/cpu_kernel.py)."""
from __future__ import annotations

import os
import shutil


def cxx_compiler() -> str | None:
    """``$CXX``, else g++ or c++, or None when the machine has none."""
    return shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")
