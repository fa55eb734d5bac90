"""The memory allocator tritonserver and its model processes run with (``--malloc``).

jemalloc and tcmalloc (Debian's ``libjemalloc2`` and ``libtcmalloc-minimal4``) are
preloaded into tritonserver, and through it into every Python-backend stub, with
``LD_PRELOAD``; vLLM's CPU build recommends the same for its worker. ``auto`` (the
default) takes jemalloc where the host has it, else glibc's malloc: jemalloc measured
fastest through the server here (docs/BENCHMARKS.md, "Cores, threads and the allocator").

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
CHOICES = ("auto", "system", *LIBRARIES)
AUTO = "jemalloc"   # what auto takes where it is installed
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}


class AllocatorNotFound(RuntimeError):
    """``--malloc`` names an allocator this host does not have."""


def _lib_dirs() -> list[Path]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    return [Path(d) for d in (*dirs, "/usr/lib64", "/usr/lib", "/usr/local/lib")]


def find_allocator(name: str, dirs: list[Path] | None = None) -> str | None:
    """The path of ``name``'s library to preload; None for "system" (glibc's malloc), and
    for "auto" where :data:`AUTO` is not installed."""
    if name == "system":
        return None
    if name == "auto":
        try:
            return find_allocator(AUTO, dirs)
        except AllocatorNotFound:
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
