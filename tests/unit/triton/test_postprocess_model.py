"""The postprocess model (backends/triton/postprocess_model.py): not batched, and the
way a cancelled ensemble request reaches the engine."""

from __future__ import annotations

import time

from .fakes import FINAL, FakeEngine, Request
from .model_calls import outputs, streaming_one_token, token_request, wait_for


def test_postprocess_is_not_dynamically_batched():
    """Triton's dynamic batcher finishes a cancelled request without executing it, so a
    batched postprocess would never see the client's cancellation it carries to the
    engine (an e2e cancellation test caught it: the engine never aborted)."""
    from pathlib import Path

    config = (Path(__file__).resolve().parents[3] / "model_repository/postprocess/config.pbtxt").read_text()
    lines = [line.split("#")[0] for line in config.splitlines()]
    assert not any("dynamic_batching" in line for line in lines)
    assert "max_batch_size: 1" in lines


def test_a_cancelled_ensemble_request_reaches_the_engine_through_postprocess(model, pb_utils):
    """Triton cancels the postprocess step that follows a cancelled ensemble, not the engine
    step in flight: postprocess must hand the reply's cancel token back to the llm model."""
    from tandem.backends.triton.postprocess_model import TritonPythonModel as Postprocess

    engine = FakeEngine.instances[-1]
    request, on_output = streaming_one_token(model, engine, prompt_echo="x: ")
    model.replies.flush()
    (out, _), = outputs(request.sender)
    assert out["prompt_echo"][0, 0] == b"x: "      # relayed unread

    post = Postprocess()
    post.initialize({})
    step = Request(**{k: v for k, v in out.items() if k != "output_ids"})   # tandem maps no output_ids
    (response,) = post.execute([step])
    assert response.error is None and response.outputs["text_output"][0] == b"x:  a"

    step.cancelled = True            # the ensemble's client cancelled
    (response,) = post.execute([step])
    assert engine.aborted == []      # asked once per interval per stream: not yet
    time.sleep(post.cancel_checks.interval_s)
    (response,) = post.execute([step])
    # answered normally: a failing step while decode streams would leak the ensemble request
    assert response.error is None
    wait_for(lambda: engine.aborted == ["req-0"])
    model.replies.flush()
    last, flags = request.sender.sent[-1]
    assert flags & FINAL and last is None      # the bare final flag, no error
    assert not request.cancelled     # the engine step itself never saw a cancellation
    (response,) = post.execute([step])         # a late reply's token is no longer known
    assert response.error is None and engine.aborted == ["req-0"]
