"""The memory allocator tritonserver and its model processes run with (``--malloc``).

glibc's malloc is the default. jemalloc and tcmalloc (Debian's ``libjemalloc2`` and
``libtcmalloc-minimal4``) are preloaded into tritonserver, and through it into every
Python-backend stub, with ``LD_PRELOAD``; vLLM's CPU build recommends the same for its
worker. Neither is the default: jemalloc measured 1.05-1.15x glibc's tokens through the
server, but under it tritonserver 2.51 answers a request error (HTTP 400) with 500, so
something in it depends on what freed memory holds; tcmalloc measured within noise
(docs/BENCHMARKS.md, "The real model: placement and allocator").

>>> preload_env({"LD_PRELOAD": "/x.so"}, "/usr/lib/libjemalloc.so.2")["LD_PRELOAD"]
'/usr/lib/libjemalloc.so.2:/x.so'
>>> preload_env({}, None)
{}
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

# the shared library each allocator is, in the order they are looked for
LIBRARIES = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
}
CHOICES = ("system", *LIBRARIES)
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}


class AllocatorNotFound(RuntimeError):
    """``--malloc`` names an allocator this host does not have."""


def _lib_dirs() -> list[Path]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    return [Path(d) for d in (*dirs, "/usr/lib64", "/usr/lib", "/usr/local/lib")]


def find_allocator(name: str, dirs: list[Path] | None = None) -> str | None:
    """The path of ``name``'s library to preload; None for "system" (glibc's malloc)."""
    if name == "system":
        return None
    if name not in LIBRARIES:
        raise AllocatorNotFound(f"--malloc {name!r}: allowed: {', '.join(CHOICES)}")
    for d in dirs if dirs is not None else _lib_dirs():
        for lib in LIBRARIES[name]:
            if (d / lib).is_file():
                return str(d / lib)
    raise AllocatorNotFound(
        f"--malloc {name}: none of {', '.join(LIBRARIES[name])} found "
        f"(on Debian/Ubuntu: apt-get install {PACKAGES[name]})")


def preload_env(env: dict[str, str], library: str | None) -> dict[str, str]:
    """``env`` with ``library`` first on LD_PRELOAD (unchanged for None)."""
    if library is None:
        return env
    rest = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = ":".join(p for p in (library, rest) if p)
    return env
