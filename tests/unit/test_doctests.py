"""Every docstring example in the packages runs and shows what it claims (from the
repository root, where the demo checkpoints are). Modules that import Triton's
Python utilities run only inside a stub; their helpers' examples run here."""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"backends": "tandem.backends", "rdma": "tandem.rdma", "client": "tandem.client"}


def modules() -> list[str]:
    out = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "import triton_python_backend_utils" in path.read_text():
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            out.append(".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return out


@pytest.mark.parametrize("name", modules())
def test_docstring_examples(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = doctest.testmod(importlib.import_module(name), report=True)
    assert result.failed == 0
