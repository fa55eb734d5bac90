"""Locate the tritonserver that ships inside the nvidia-pytriton wheel.

nvidia-pytriton 0.7.0 carries a complete tritonserver 2.51: the binary, the
Python backend (``libtriton_python.so``) and one backend stub per Python
version. Triton expects the stub *beside* ``libtriton_python.so`` in a backend
directory, so :func:`prepare_backend_dir` assembles one in a run directory, and
:func:`server_env` builds the environment the server (and through it the
stub) must run in:

- ``LD_LIBRARY_PATH`` holds the wheel's bundled libraries
  (``nvidia_pytriton.libs``). The binaries find them through an ``$ORIGIN``
  rpath, which breaks once the stub is copied elsewhere.
- ``PATH`` starts with this interpreter's ``bin`` so the embedded interpreter
  in the stub resolves ``python3`` to the venv and imports its packages.

>>> layout = find_triton()                       # doctest: +SKIP
>>> backend_dir = prepare_backend_dir(layout, run_dir)  # doctest: +SKIP
>>> env = server_env(layout)                     # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

STUB_NAME = "triton_python_backend_stub"
BACKEND_LIB = "libtriton_python.so"
UTILS_NAME = "triton_python_backend_utils.py"


class TritonNotFound(RuntimeError):
    """A part of the tritonserver distribution is missing."""


@dataclass(frozen=True, slots=True)
class TritonLayout:
    """Where the parts of the wheel's tritonserver live."""

    server_bin: Path       # .../pytriton/tritonserver/bin/tritonserver
    python_backend: Path   # directory holding libtriton_python.so
    stub: Path             # python_backend_stubs/<X.Y>/triton_python_backend_stub
    libs_dir: Path         # <site-packages>/nvidia_pytriton.libs
    python_bin_dir: Path   # the interpreter's bin directory (venv first on PATH)


def _pytriton_root() -> Path:
    try:
        import pytriton  # noqa: PLC0415 - only to locate the wheel
    except ImportError as exc:  # pragma: no cover - dependency of the project
        raise TritonNotFound(
            "nvidia-pytriton is not installed; it provides tritonserver. "
            "Install the project with `pip install -e .` (it pins nvidia-pytriton==0.7.0)."
        ) from exc
    return Path(pytriton.__file__).resolve().parent


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise TritonNotFound(f"{what} not found at {path} (is nvidia-pytriton==0.7.0 installed intact?)")
    return path


def find_triton(python_version: str | None = None, server_bin: str | Path | None = None) -> TritonLayout:
    """Find tritonserver, the Python backend and the stub for this interpreter.

    ``server_bin`` is another tritonserver 2.51 than the wheel's, e.g. the NGC container's
    ``/opt/tritonserver/bin/tritonserver`` (``tandem serve --tritonserver``): its Python
    backend (``../backends/python``) is used when it has one; the stub is still the
    wheel's, built for this interpreter (the container's is for the system Python).
    """
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = _pytriton_root() / "tritonserver"
    python_backend = dist / "backends" / "python"
    if server_bin:
        server_bin = Path(server_bin)
        if not (server_bin.is_file() and os.access(server_bin, os.X_OK)):
            raise TritonNotFound(f"--tritonserver {server_bin}: not an executable file")
        own_backend = server_bin.resolve().parent.parent / "backends" / "python"
        if (own_backend / BACKEND_LIB).exists():
            python_backend = own_backend
    else:
        server_bin = _require(dist / "bin" / "tritonserver", "tritonserver binary")
    _require(python_backend / BACKEND_LIB, "Python backend library")
    stubs = dist / "python_backend_stubs"
    stub = stubs / version / STUB_NAME
    if not stub.exists():
        have = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
        raise TritonNotFound(
            f"no Python backend stub for Python {version} at {stub}; the wheel ships stubs for {have}"
        )
    libs_dir = _require(dist.parent.parent / "nvidia_pytriton.libs", "bundled tritonserver libraries")
    return TritonLayout(
        server_bin=server_bin,
        python_backend=python_backend,
        stub=stub,
        libs_dir=libs_dir,
        python_bin_dir=Path(sys.executable).parent,
    )


def prepare_backend_dir(layout: TritonLayout, run_dir: Path) -> Path:
    """Assemble ``<run_dir>/backends/python/`` (library + stub + utils); return ``<run_dir>/backends``."""
    backends = Path(run_dir) / "backends"
    python_dir = backends / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    _link_or_copy(layout.python_backend / BACKEND_LIB, python_dir / BACKEND_LIB)
    utils = layout.python_backend / UTILS_NAME
    if utils.exists():
        _link_or_copy(utils, python_dir / UTILS_NAME)
    # The stub is copied, not linked: Triton resolves the stub path relative to
    # the backend directory and execs it, and a copy keeps the run dir self-contained.
    stub_dst = python_dir / STUB_NAME
    if not stub_dst.exists() or stub_dst.stat().st_size != layout.stub.stat().st_size:
        shutil.copy2(layout.stub, stub_dst)
    stub_dst.chmod(0o755)
    return backends


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    try:
        dst.symlink_to(src)
    except OSError:
        shutil.copy2(src, dst)


def _libpython_dir() -> list[str]:
    """This interpreter's libpython directory, when it has a shared one.

    The stub links ``libpython3.X.so.1.0``; without this the loader takes the
    system's copy, whose patch level may differ from the venv's interpreter.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).exists():
        return [libdir]
    return []


def server_env(layout: TritonLayout, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: bundled libs on LD_LIBRARY_PATH, venv bin first on PATH."""
    env = dict(os.environ if base is None else base)
    lib_paths = [str(layout.libs_dir), *_libpython_dir()]
    if env.get("LD_LIBRARY_PATH"):
        lib_paths.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_paths)
    env["PATH"] = os.pathsep.join(p for p in (str(layout.python_bin_dir), env.get("PATH", "")) if p)
    # A virtualenv is recognised from the interpreter found on PATH; a stray
    # PYTHONHOME would override that and load another installation's stdlib.
    env.pop("PYTHONHOME", None)
    return env
