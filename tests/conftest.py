"""Shared fixtures for both test tiers."""

from __future__ import annotations

import pytest


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
