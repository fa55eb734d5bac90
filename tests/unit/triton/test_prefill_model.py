"""How kv_transfer hands a job to this server's ``prefill`` model
(backends/triton/prefill_handoff.py), on the stand-in ``triton_python_backend_utils``
with a fake BLS call: a taken job, a refused one (the job is wrong: ValueError), and a
model that is dead, restarting or hung (PrefillUnavailable, then skipped a while with
``on_down`` told until when, and ``on_down(None)`` once it takes a job again)."""

from __future__ import annotations

import threading

import numpy as np
import pytest


class FakeBLS:
    """``pb_utils.InferenceRequest`` whose ``exec`` answers as ``answer`` says: "ack",
    an error code, "raise" (the call itself fails) or "hang" (until released)."""
    answer = "ack"
    calls: list = []
    release = threading.Event()

    def __init__(self, model_name, inputs, requested_output_names):
        self.model_name, self.inputs = model_name, {t.name(): t.as_numpy() for t in inputs}
        self.outputs = requested_output_names

    def exec(self):
        FakeBLS.calls.append((self.model_name, self.inputs))
        answer = FakeBLS.answer
        if answer == "raise":
            raise RuntimeError("Request for unknown model: 'prefill' is not found")
        if answer == "hang":
            FakeBLS.release.wait(10)
        return _Response(None if answer in ("ack", "hang") else answer)


class _Response:
    def __init__(self, code):
        self.code = code

    def has_error(self):
        return self.code is not None

    def error(self):
        import triton_python_backend_utils as pb_utils
        return pb_utils.TritonError(f"the prefill said {self.code}", self.code)


@pytest.fixture
def handoff(pb_utils, monkeypatch):
    monkeypatch.setattr(pb_utils, "InferenceRequest", FakeBLS, raising=False)
    FakeBLS.answer, FakeBLS.calls = "ack", []
    FakeBLS.release.clear()
    from tandem.backends.triton.prefill_handoff import LocalPrefill
    downs = []
    side = LocalPrefill(timeout_s=0.2, on_down=downs.append)
    yield side, downs
    FakeBLS.release.set()
    side.close()


def job(side, salt=None):
    return side.submit(np.array([5, 6, 7], dtype=np.int32), np.frombuffer(b"desc", dtype=np.uint8), salt)


def test_a_taken_job_reaches_the_prefill_model_with_its_salt(handoff):
    side, downs = handoff
    assert job(side, "tenant-a") == "prefill"
    [(model, inputs)] = FakeBLS.calls
    assert model == "prefill"
    assert inputs["input_ids"].tolist() == [[5, 6, 7]] and inputs["kv_descriptor"].tobytes() == b"desc"
    assert inputs["cache_salt"].tolist() == [[b"tenant-a"]]
    assert downs == []


def test_a_job_the_prefill_refuses_is_the_jobs_error(handoff, pb_utils):
    side, downs = handoff
    FakeBLS.answer = pb_utils.TritonError.INVALID_ARG
    with pytest.raises(ValueError, match="the prefill said INVALID_ARG"):
        job(side)
    assert downs == []          # the prefill side is fine: the next job goes there
    FakeBLS.answer = "ack"
    job(side)


@pytest.mark.parametrize("failure", ["UNAVAILABLE", "INTERNAL", "raise", "hang"])
def test_a_prefill_that_takes_no_job_is_skipped_then_tried_again(handoff, failure, monkeypatch):
    from tandem.backends.triton import prefill_handoff
    from tandem.backends.triton.prefill_router import PrefillUnavailable

    side, downs = handoff
    now = [100.0]
    monkeypatch.setattr(prefill_handoff.time, "monotonic", lambda: now[0])
    FakeBLS.answer = failure
    with pytest.raises(PrefillUnavailable, match="retry"):
        job(side)
    [until] = downs
    assert until >= now[0] + prefill_handoff.LOCAL_WHILE_DOWN_S   # long prompts stay in decode
    with pytest.raises(PrefillUnavailable, match="skipped"):
        job(side)                           # not asked again while it is down
    assert len(FakeBLS.calls) == 1
    FakeBLS.answer = "ack"
    FakeBLS.release.set()
    now[0] += 31.0                          # past any back-off
    job(side)
    assert downs == [until, None]           # up again: routing forgets the outage
