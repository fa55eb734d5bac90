"""Shared fixtures for both test tiers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def auto_dtype_is_float32():
    """``dtype="auto"`` is float32 in the tests, whatever this CPU's flags: they compare
    greedy texts token for token (with HF, across batch shapes and speculation), which
    bf16 keeps only at a fixed step shape. The choice itself is tested with given flags
    (test_dtype_auto.py); servers the tests start as a command get ``--dtype float32``."""
    from tandem.backends.models import dtype

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dtype, "cpu_flags", lambda: frozenset())
        yield


@pytest.fixture(scope="session", autouse=True)
def engines_run_eagerly():
    """Engines the tests make run eagerly, as on a machine without a C++ compiler:
    compiling at start-up would add seconds to each. The compiled steps are tested on
    their own (tests/unit/engine/test_compiled_decode.py, which turns the probe back on);
    servers the tests start as a command compile as a user's would."""
    from tandem.backends.engine import config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "cxx_compiler", lambda: None)
        yield


@pytest.fixture(scope="session", autouse=True)
def servers_run_eagerly():
    """Servers the tests start decode eagerly (``enforce_eager`` unless a test says
    otherwise; the command-line ones get ``--enforce-eager``): compiling at start-up
    costs every server start tens of seconds to minutes on this 2-core kind of machine,
    more than a readiness timeout when two engines compile at once. The compiled step is
    tested in tests/unit/engine/test_compiled_decode.py (equal to eager, greedy equal to
    HF, the cache across processes)."""
    from tandem.client.serve.options import ServeOptions

    of = ServeOptions.of.__func__

    def eager_of(cls, **values):
        values.setdefault("enforce_eager", True)
        return of(cls, **values)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ServeOptions, "of", classmethod(eager_of))
        yield


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    """The tiny untrained demo checkpoint (2-layer Llama, 2000-token BPE), built once per session."""
    from tandem.client.demo_checkpoint import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo-untrained")


@pytest.fixture(scope="session")
def random_mtp_head(demo_checkpoint, tmp_path_factory):
    """An untrained MTP head for the demo checkpoint (fixed seed): most drafts rejected."""
    import torch

    from tandem.backends.models import load_model
    from tandem.backends.models.mtp import MTPHead, save_mtp_head
    out = tmp_path_factory.mktemp("mtp") / "random-mtp"
    torch.manual_seed(5)
    save_mtp_head(MTPHead(load_model(str(demo_checkpoint)).config), out, torch.float32)
    return out
