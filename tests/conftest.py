"""Shared fixtures for both test tiers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    """The tiny untrained demo checkpoint (2-layer Llama, 2000-token BPE), built once per session."""
    from tandem.client.demo_checkpoint import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo-untrained")
