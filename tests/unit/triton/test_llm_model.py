"""The llm model (backends/triton/llm_model.py) on a fake engine: its streams, samples,
errors, cancellation, metrics and shutdown.

``triton_python_backend_utils`` and the engine are the stand-ins of ``fakes``.
"""

from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest

from tandem.backends.triton.latency import StreamClock
from tandem.backends.triton.perf_outputs import PERF_OUTPUT_NAMES

from .fakes import FINAL, VOCAB, FakeEngine, MetricFamily, Request, TritonError, TritonModelException, metric
from .model_calls import (arrays, model_args, model_config, outputs, streaming_one_token, texts, the_error,
                          token_request, wait_for)


def test_initialize_configures_engine_and_threads(model, ckpt_dir):
    import torch
    engine = FakeEngine.instances[-1]
    assert engine.started and engine.model_dir == str(ckpt_dir)
    assert engine.kwargs == dict(dtype="float32", page_size=16, kv_layout="HND", num_pages=None,
                                 max_num_seqs=64, max_num_batched_tokens=512, speculative=None,
                                 enable_prefix_caching=True, model_version="1",
                                 compile="auto", compile_cache_dir=None, enforce_eager=False, kv_audit=0.01,
                                 kv_audit_recompute=0.0, max_loras=0, max_lora_rank=16,
                                 tensor_parallel_size=1)
    assert torch.get_num_threads() == 1


def test_not_decoupled_is_refused(model_cls, ckpt_dir):
    with pytest.raises(TritonModelException, match="'llm' streams tokens and must be decoupled"):
        model_cls().initialize({"model_config": json.dumps(model_config(str(ckpt_dir), decoupled=False)),
                                "model_name": "llm"})


def test_streaming_sends_token_ids_and_text_per_step_then_final(model):
    request = token_request(stream=True, max_tokens=3, temperature=0.0)
    assert model.execute([request]) is None
    engine = FakeEngine.instances[-1]
    prompt, params, _ = engine.submitted[0]
    assert prompt == [5, 6, 7] and params.max_tokens == 3 and params.temperature == 0.0
    engine.emit(0, [" a", " b", " c"], reason="length")
    sent = outputs(request.sender)
    assert texts(request.sender) == [" a", " b", " c"]
    assert [o["output_ids"].tolist() for o, _ in sent] == [[[10]], [[11]], [[12]]]
    assert [bool(flags & FINAL) for _, flags in sent] == [False, False, True]
    assert [o["finish_reason"][0, 0] for o, _ in sent] == [b"", b"", b"length"]
    assert [int(o["num_output_tokens"][0, 0]) for o, _ in sent] == [1, 2, 3]
    assert int(sent[-1][0]["num_input_tokens"][0, 0]) == 3
    tokens = {o["cancel_token"][0, 0] for o, _ in sent}
    assert len(tokens) == 1 and tokens.pop().startswith(b"llm_")  # one token per sequence
    assert metric("tandem_requests_in_engine") == 0
    assert metric("tandem_requests_finished_total", reason="length") == 1
    assert metric("tandem_engine_dtype_info", dtype="float32") == 1   # the dtype it runs, auto resolved


def test_non_streaming_sends_every_token_once_without_the_prompt(model):
    request = token_request()
    model.execute([request])
    FakeEngine.instances[-1].emit(0, ["1", "", "2"], reason="stop")
    (out, flags), = outputs(request.sender)
    assert flags & FINAL
    assert texts(request.sender) == ["12"]    # the prompt echo is postprocess's business
    assert out["output_ids"].tolist() == [[10, 11, 12]]
    assert out["finish_reason"][0, 0] == b"stop"


def test_num_return_sequences_submits_one_engine_request_per_sample(model):
    """n independent samples of one prompt (seeded: seed + i), each reply with its
    sequence_index; each sample's last reply its finish reason; final after the last."""
    engine = FakeEngine.instances[-1]
    request = token_request(stream=True, num_return_sequences=2, seed=5)
    model.execute([request])
    assert [p.seed for _, p, _ in engine.submitted] == [5, 6]
    engine.emit(1, ["x", "y"], reason="stop")
    engine.emit(0, ["a"], reason="length")
    sent = outputs(request.sender)
    assert [(int(o["sequence_index"][0, 0]), o["text_output"][0, 0], o["finish_reason"][0, 0])
            for o, _ in sent] == [(1, b"x", b""), (1, b"y", b"stop"), (0, b"a", b"length")]
    assert [bool(flags & FINAL) for _, flags in sent] == [False, False, True]
    assert len(model.in_flight) == 0 and engine.aborted == []


def test_non_streaming_samples_answer_once_each(model):
    engine = FakeEngine.instances[-1]
    request = token_request(num_return_sequences=3)
    model.execute([request])
    assert [p.seed for _, p, _ in engine.submitted] == [None] * 3    # unseeded: independent
    for i in (2, 0, 1):
        engine.emit(i, [f"{i}a", f"{i}b"])
    assert [(int(o["sequence_index"][0, 0]), o["text_output"][0, 0].decode(), bool(f & FINAL))
            for o, f in outputs(request.sender)] == [(2, "2a2b", False), (0, "0a0b", False), (1, "1a1b", True)]


def test_a_failing_sample_ends_the_request_and_aborts_its_siblings(model):
    engine = FakeEngine.instances[-1]
    request = token_request(stream=True, num_return_sequences=3)
    model.execute([request])
    engine.emit(0, ["a"], reason="length")
    engine.emit(1, ["b", ""], reason="error")
    response, flags = request.sender.sent[-1]
    assert flags & FINAL and response.error.code() == TritonError.INTERNAL
    assert engine.aborted == ["req-2"] and len(model.in_flight) == 0


def test_a_refused_sample_refuses_the_request_and_aborts_the_others(model):
    engine = FakeEngine.instances[-1]
    submit = engine.submit
    engine.submit = lambda prompt, params, cb, lora=None: (submit(prompt, params, cb) if len(engine.submitted) < 1
                                                else (_ for _ in ()).throw(ValueError("the pool is too small")))
    request = token_request(num_return_sequences=2)
    model.execute([request])
    assert "the pool is too small" in the_error(request.sender).message()
    assert engine.aborted == ["req-0"] and len(model.in_flight) == 0


@pytest.mark.parametrize("stream", [True, False])
def test_log_probs_are_returned_when_asked(model, stream):
    engine = FakeEngine.instances[-1]
    asked, plain = token_request(stream=stream, return_log_probs=True), token_request(stream=stream)
    model.execute([asked, plain])
    assert [p.logprobs for _, p, _ in engine.submitted] == [True, False]
    engine.emit(0, ["a", "b"], logprobs=[-0.5, -0.25])
    engine.emit(1, ["a", "b"], logprobs=[-0.5, -0.25])   # the engine's, not asked for: not sent
    got = [(o["output_log_probs"].tolist(), float(o["cum_log_probs"][0, 0])) for o, _ in outputs(asked.sender)]
    assert got == ([([[[-0.5]]], -0.5), ([[[-0.25]]], -0.75)] if stream else [([[[-0.5, -0.25]]], -0.75)])
    assert {(o["output_log_probs"].shape[-1], float(o["cum_log_probs"][0, 0]))
            for o, _ in outputs(plain.sender)} == {(0, 0.0)}


@pytest.mark.parametrize("inputs,message", [
    (dict(max_tokens=0), "max_tokens: got 0; allowed: an integer >= 1"),
    (dict(input_ids=[]), "input_ids: is empty; allowed: a non-empty list of token ids"),
    (dict(input_ids=[1, VOCAB]), f"input_ids: token id {VOCAB} is not in the vocabulary; "
                                 f"allowed: ids in [0, {VOCAB - 1}]"),
    (dict(input_ids=[1] * 60, max_tokens=10), "max_tokens: got 10; the prompt has 60 tokens of a 64-token "
                                              "context; allowed: <= 4"),
])
def test_bad_input_gets_an_error_response_and_never_reaches_the_engine(model, inputs, message):
    request = Request(**arrays(**{"input_ids": (5, 6), **inputs}))
    model.execute([request])
    error = the_error(request.sender)
    assert error.code() == TritonError.INVALID_ARG
    assert error.message() == message
    assert FakeEngine.instances[-1].submitted == []
    assert metric("tandem_requests_finished_total", reason="rejected") == 1


def test_engine_rejection_is_returned_as_error(model):
    FakeEngine.instances[-1].reject = "request needs 9 KV pages (40 tokens), the pool has 4"
    request = token_request(max_tokens=30)
    model.execute([request])
    assert "KV pages" in the_error(request.sender).message()
    assert metric("tandem_requests_in_engine") == 0


def test_one_bad_request_does_not_affect_the_others(model):
    good, bad = token_request(stream=True), token_request(())
    model.execute([bad, good])
    FakeEngine.instances[-1].emit(0, ["ok"])
    assert "input_ids" in the_error(bad.sender).message()
    assert texts(good.sender) == ["ok"] and good.sender.final


def test_cancelled_request_gets_final_and_is_aborted(model):
    engine = FakeEngine.instances[-1]
    request, on_output = streaming_one_token(model, engine)
    request.cancelled = True
    wait_for(lambda: engine.aborted == ["req-0"])
    assert model.replies.flush() and request.sender.final
    response, _ = request.sender.sent[-1]
    assert response.error.code() == TritonError.CANCELLED
    # the engine's own abort output arrives later and is dropped (Sender asserts nothing follows FINAL)
    on_output(types.SimpleNamespace(request_id="req-0", new_token_ids=[], new_text="", finished=True,
                                    finish_reason="abort", num_prompt_tokens=3, num_output_tokens=1))
    assert texts(request.sender) == [" a"]
    assert metric("tandem_requests_finished_total", reason="abort") == 1
    assert metric("tandem_requests_in_engine") == 0


def test_a_stop_request_ends_the_stream_with_its_request_id(model):
    """TensorRT-LLM's stop convention: a second request with ``stop`` = true and the same
    request id (its input_ids empty, as inflight_batcher_llm_client sends it) ends the
    first stream with its final flag and the engine aborts the sequence; the stop request
    gets an empty final response. A stop naming no stream in flight is an error."""
    engine = FakeEngine.instances[-1]
    request, _ = streaming_one_token(model, engine, request_id="42")
    stop = token_request(ids=(), stop=True, request_id="42")
    model.execute([stop])
    assert engine.aborted == ["req-0"] and stop.sender.final and stop.sender.sent[-1][0] is None
    assert model.replies.flush() and request.sender.final
    assert request.sender.sent[-1][0] is None or request.sender.sent[-1][0].error is None   # ended, not failed
    assert texts(request.sender) == [" a"]
    again = token_request(ids=(), stop=True, request_id="42")
    model.execute([again])
    assert "no stream with request id '42'" in the_error(again.sender).message()
    anonymous = token_request(ids=(), stop=True)
    model.execute([anonymous])
    assert "request id" in the_error(anonymous.sender).message()


def test_an_ensemble_step_is_not_polled_for_cancellation(model):
    """Triton never cancels an ensemble step in flight: a text ensemble's step (it carries
    prompt_echo) is not asked is_cancelled(); a direct client's request is."""
    asked = {"ensemble": 0, "direct": 0}
    requests = {"ensemble": token_request(stream=True, max_tokens=50, prompt_echo=""),
                "direct": token_request(stream=True, max_tokens=50)}
    for kind, request in requests.items():
        request.is_cancelled = lambda kind=kind: asked.__setitem__(kind, asked[kind] + 1) or False
        model.execute([request])
    wait_for(lambda: asked["direct"] >= 3)
    assert asked["ensemble"] == 0


@pytest.mark.parametrize("extra", [{}, {"return_log_probs": True}, {"num_return_sequences": 2},
                                   {"return_perf_metrics": True}, {"stream": False, "prompt_echo": "p:"}])
def test_an_ensemble_steps_replies_leave_out_what_postprocess_defaults(model, extra):
    """In a text ensemble (prompt_echo sent) a reply carries no empty echo, no log probs
    unless asked, no sequence index with one sample; postprocess answers the same."""
    from tandem.backends.triton.postprocess import ensemble_outputs
    from tandem.backends.triton.response_arrays import ENGINE_OUTPUT_NAMES, PROMPT_OUTPUT_NAMES, TOP_OUTPUT_NAMES

    engine = FakeEngine.instances[-1]
    flags = {"stream": True, "prompt_echo": "", **extra}
    lean, full = token_request(**flags), token_request(**{k: v for k, v in flags.items() if k != "prompt_echo"})
    for request in (lean, full):
        model.execute([request])
        for i in range(len(engine.submitted) - flags.get("num_return_sequences", 1), len(engine.submitted)):
            engine.emit(i, [" a", " b"], logprobs=[-0.5, -1.0] if "return_log_probs" in extra else None)
    left_out = {"prompt_echo"} if not flags["prompt_echo"] else set()
    left_out |= {"cum_log_probs", "output_log_probs"} if "return_log_probs" not in extra else set()
    left_out |= {"sequence_index"} if "num_return_sequences" not in extra else set()
    left_out |= set(PERF_OUTPUT_NAMES) - {"num_cached_tokens"} if "return_perf_metrics" not in extra else set()
    left_out |= set(TOP_OUTPUT_NAMES) | set(PROMPT_OUTPUT_NAMES)    # no alternatives or prompt asked
    for (a, _), (b, _) in zip(outputs(lean.sender), outputs(full.sender), strict=True):
        assert set(a) == (set(ENGINE_OUTPUT_NAMES) | {"cancel_token", "prompt_echo"}) - left_out
        b = {**b, "prompt_echo": np.array([[flags["prompt_echo"].encode()]], dtype=object)}
        a_out, b_out = ensemble_outputs(a.get), ensemble_outputs(b.get)
        assert a_out.keys() == b_out.keys()
        for name in a_out:
            assert a_out[name].tolist() == b_out[name].tolist(), name


def test_finished_requests_are_not_polled(model):
    engine = FakeEngine.instances[-1]
    request = token_request()
    model.execute([request])
    engine.emit(0, ["done"])
    request.cancelled = True  # after the fact: nothing more may be sent, nothing aborted
    time.sleep(0.05)
    assert engine.aborted == [] and len(request.sender.sent) == 1
    assert len(model.in_flight) == 0


def test_engine_failure_ends_the_stream_with_an_error(model):
    request = token_request(stream=True)
    model.execute([request])
    FakeEngine.instances[-1].emit(0, ["a", ""], reason="error")
    assert texts(request.sender) == ["a"]
    response, flags = request.sender.sent[-1]
    assert flags & FINAL and response.error.code() == TritonError.INTERNAL


def test_metrics_are_updated_one_at_a_time(model):
    """Execute and engine threads update the same metrics; the Python backend's metric
    updates are not thread-safe (concurrent ones crashed the server)."""
    import threading

    def updates(fn):
        for _ in range(100):
            fn()
    from tandem.backends.engine.llm_engine import RequestOutput
    done = RequestOutput("r", [5, 6], "ab", True, "length", 3, 2)
    threads = [threading.Thread(target=updates, args=(model.metrics.submitted,)),
               threading.Thread(target=updates, args=(lambda: model.metrics.output(
                   model.metrics.submitted() and StreamClock(), done),)),
               threading.Thread(target=updates, args=(model._poll_metrics,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert MetricFamily.overlaps[0] == 0
    assert metric("tandem_requests_in_engine") == 100
    assert metric("tandem_requests_finished_total", reason="length") == 100
    assert metric("tandem_time_to_first_token_seconds") == 100     # observations
    assert metric("tandem_generation_tokens_total") == 200
    assert (metric("tandem_kv_pages", state="free"), metric("tandem_kv_pages", state="in_use")) == (30, 2)


def test_finalize_ends_open_streams_and_stops_the_engine(model_cls, ckpt_dir):
    m = model_cls()
    m.initialize(model_args(ckpt_dir))
    engine = FakeEngine.instances[-1]
    request = token_request(stream=True)
    m.execute([request])
    m.finalize()
    assert engine.stopped and engine.aborted == ["req-0"]
    response, flags = request.sender.sent[-1]
    assert flags & FINAL and response.error.code() == TritonError.UNAVAILABLE


def test_an_adapter_on_a_server_without_adapters_is_refused_before_the_engine(model):
    engine = FakeEngine.instances[-1]
    before = len(engine.submitted)
    request = token_request(lora_name="sql")
    model.execute([request])
    assert "lora_name: got 'sql', but this server serves no LoRA adapters" in the_error(request.sender).message()
    assert len(engine.submitted) == before
