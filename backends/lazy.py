"""Lazy package exports (PEP 562): a package's ``__init__`` names what it offers, and
a name's module is imported on first use. So ``import tandem.backends.triton.x``
loads only what ``x`` imports, not torch and the whole engine behind every
package ``__init__`` on the way."""
from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps each public name to
    the relative module that defines it.

    >>> __getattr__ = lazy_exports("tandem.backends.kv_cache", {"PageAllocator": ".allocator"})
    >>> __getattr__("PageAllocator").__name__
    'PageAllocator'
    """
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)
    return __getattr__
