"""The prefill model (model_repository/prefill/1/model.py, backends/triton/prefill_*.py):
its adapter picks the role — forward to prefill servers, or prefill itself."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from .fakes import Request
from .model_calls import model_config


PREFILL_MODULES = ("prefill_model", "prefill_local", "prefill_remote")


@pytest.fixture
def prefill_adapter(pb_utils, monkeypatch):
    """``model_repository/prefill/1/model.py`` loaded as the stub loads it, with the
    router replaced by a fake that records the jobs it forwards."""
    import importlib
    import importlib.util
    from pathlib import Path

    for name in PREFILL_MODULES:   # imported afresh, on the stand-in
        monkeypatch.delitem(sys.modules, f"tandem.backends.triton.{name}", raising=False)
    prefill_remote = importlib.import_module("tandem.backends.triton.prefill_remote")

    class FakeRouter:
        jobs: list = []
        salts: list = []
        fail: Exception | None = None

        def __init__(self, endpoints, on_down=None, **options):
            self.endpoints, self.closed, self.options = endpoints, False, options

        def submit(self, ids, desc, cache_salt=None):
            if FakeRouter.fail is not None:
                raise FakeRouter.fail
            FakeRouter.jobs.append((ids, desc))
            FakeRouter.salts.append(cache_salt)

        def close(self):
            self.closed = True
    monkeypatch.setattr(prefill_remote, "PrefillRouter", FakeRouter)
    path = Path(__file__).resolve().parents[3] / "model_repository/prefill/1/model.py"
    spec = importlib.util.spec_from_file_location("prefill_adapter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel, FakeRouter


def prefill_args(**params):
    return {"model_config": json.dumps(model_config(decoupled=False, **params)), "model_name": "prefill"}


def prefill_request(desc: bytes, ids=(5, 6, 7), **extra):
    return Request(kv_descriptor=np.frombuffer(desc, dtype=np.uint8).reshape(1, -1),
                   input_ids=np.array([list(ids)], dtype=np.int32), **extra)


def a_descriptor() -> bytes:
    from tandem.rdma import DestinationDescriptor, ModelSpec, ShardScheme
    return DestinationDescriptor(b"worker", 0, 1, 2, (0,), (ModelSpec("target", 2, 2, 4, 2, "float32", "HND"),),
                                 ShardScheme(1), ShardScheme(1)).to_bytes()


def test_the_prefill_model_forwards_with_endpoints_and_prefills_itself_without(prefill_adapter):
    from tandem.backends.triton.prefill_local import LocalPrefillModel
    from tandem.backends.triton.prefill_model import prefill_model_for
    from tandem.backends.triton.prefill_remote import RemotePrefillModel

    assert isinstance(prefill_model_for(prefill_args()), LocalPrefillModel)
    adapter_cls, router = prefill_adapter
    model = adapter_cls()
    model.initialize(prefill_args(prefill_endpoints="10.0.0.5:8001"))
    assert isinstance(model.model, RemotePrefillModel)
    assert model.model.router.endpoints == ["10.0.0.5:8001"]
    model.finalize()
    assert model.model.router.closed


def test_the_forwarding_prefill_model_acks_refuses_and_reports_unavailable(prefill_adapter, pb_utils):
    from tandem.backends.triton.disagg_common import NO_TRANSFER
    from tandem.backends.triton.prefill_router import PrefillUnavailable

    adapter_cls, router = prefill_adapter
    router.jobs, router.salts, router.fail = [], [], None
    model = adapter_cls()
    model.initialize(prefill_args(prefill_endpoints="10.0.0.5:8001"))
    desc = a_descriptor()
    ok, local, forged = model.execute([prefill_request(desc), prefill_request(NO_TRANSFER),
                                       prefill_request(b"\x07" * 40)])
    assert ok.error is None, ok.error.message()
    assert local.error is None and ok.outputs["prefill_ack"].all()
    assert [d.tobytes() for _, d in router.jobs] == [desc]      # the local path forwards nothing
    (salted,) = model.execute([prefill_request(desc, cache_salt=np.array([[b"tenant-a"]], dtype=object))])
    assert salted.error is None and router.salts == [None, "tenant-a"]   # the salt travels on
    assert forged.error.code() == pb_utils.TritonError.INVALID_ARG
    assert forged.error.message().startswith("kv_descriptor: ")
    router.fail = PrefillUnavailable("no prefill server took the job")
    (down,) = model.execute([prefill_request(desc)])
    assert down.error.code() == pb_utils.TritonError.UNAVAILABLE
    assert "no prefill server" in down.error.message()
    model.finalize()
