"""Fixtures of the Triton adapter tests: a checkpoint directory with only its config,
the stand-in ``triton_python_backend_utils``, and the llm model on a fake engine."""

from __future__ import annotations

import json
import sys

import pytest

from .fakes import CONTEXT, VOCAB, FakeEngine, stand_in_pb_utils
from .model_calls import model_args


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A checkpoint directory with only the config.json the models read their limits from."""
    d = tmp_path_factory.mktemp("ckpt")
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": CONTEXT}))
    return d


@pytest.fixture
def pb_utils(monkeypatch):
    m = stand_in_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", m)
    for name in ("llm_model", "postprocess_model"):
        monkeypatch.delitem(sys.modules, f"tandem.backends.triton.{name}", raising=False)
    return m


@pytest.fixture
def model_cls(pb_utils, monkeypatch):
    import tandem.backends.engine.async_engine as async_engine
    monkeypatch.setattr(async_engine, "AsyncEngine", FakeEngine)
    from tandem.backends.triton.llm_model import TritonPythonModel
    return TritonPythonModel


@pytest.fixture
def model(model_cls, ckpt_dir):
    import torch
    threads = torch.get_num_threads()
    m = model_cls()
    m.initialize(model_args(ckpt_dir))
    FakeEngine.instances[-1].flush = m.replies.flush
    yield m
    m.finalize()
    torch.set_num_threads(threads)
