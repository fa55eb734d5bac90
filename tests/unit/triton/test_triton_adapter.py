"""Tandem's Triton models without a server: the request parsers, the llm model's
streams, postprocess, and cancellation from postprocess back to the engine model.

``triton_python_backend_utils`` and the engine are the stand-ins of ``fakes``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import types
import uuid

import numpy as np
import pytest

from tandem.backends.triton.latency import StreamClock

from tandem.backends.triton.generate_request import (
    RequestError, check_context, parse_generate_request, parse_token_request)
from tandem.backends.triton.response_arrays import (OUTPUT_NAMES, TOKEN_OUTPUT_NAMES, SequenceReply, engine_arrays,
                                                    ensemble_arrays)
from tandem.backends.triton.generate_request import INPUTS
from tandem.backends.triton.settings import EngineSettings, model_limits
from tandem.backends.triton.perf_outputs import PERF_OUTPUT_NAMES

from .fakes import (CONTEXT, FINAL, VOCAB, FakeEngine, FakeTokenizer, MetricFamily, Request, SlowSender,
                    TritonError, TritonModelException, metric, stand_in_pb_utils)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A checkpoint directory with only the config.json the models read their limits from."""
    d = tmp_path_factory.mktemp("ckpt")
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": CONTEXT}))
    return d


def model_config(model_dir="/ckpt", decoupled=True, **params):
    params = {"model_dir": model_dir, "torch_threads": "1", "cancel_poll_ms": "5", **params}
    return {"name": "llm", "model_transaction_policy": {"decoupled": decoupled},
            "parameters": {k: {"string_value": str(v)} for k, v in params.items()}}


def model_args(model_dir):
    # a fresh instance name: each model binds its own cancel socket
    return {"model_config": json.dumps(model_config(str(model_dir))), "model_name": "llm", "model_version": "1",
            "model_instance_name": f"llm_{uuid.uuid4().hex[:8]}"}


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


NUMPY_TYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}
TYPES = {name: NUMPY_TYPES[t] for name, (t, _) in INPUTS.items() if t in NUMPY_TYPES}


def arrays(**extra):
    """Request tensors with the batch dimension, typed as the configs declare them."""
    out = {}
    for k, v in extra.items():
        if k in ("stop_words", "bad_words", "embedding_bias_words"):
            out[k] = np.array([[w.encode() for w in v]], dtype=object)
        elif k == "embedding_bias_weights":
            out[k] = np.array([list(v)], dtype=np.float32)
        elif k == "input_ids":
            out[k] = np.array([list(v)], dtype=np.int32)
        elif k in ("text_input", "text_output", "finish_reason", "cancel_token", "prompt_echo"):
            out[k] = np.array([[v if isinstance(v, bytes) else v.encode()]], dtype=object)
        elif k in ("num_input_tokens", "num_output_tokens"):
            out[k] = np.array([[v]], dtype=np.uint32)
        elif k == "sequence_index":
            out[k] = np.array([[v]], dtype=np.int32)
        elif k == "cum_log_probs":
            out[k] = np.array([[v]], dtype=np.float32)
        elif k == "output_log_probs":
            out[k] = np.array(v, dtype=np.float32).reshape(1, 1, -1)
        else:
            out[k] = np.array([[v]], dtype=TYPES[k])
    return out


def token_request(ids=(5, 6, 7), **extra):
    return Request(**arrays(input_ids=ids, **extra))


def outputs(sender):
    return [(r.outputs, flags) for r, flags in sender.sent if r is not None and r.error is None]


def texts(sender):
    return [o["text_output"].reshape(-1)[0].decode() for o, _ in outputs(sender)]


def the_error(sender):
    # replies leave on the model's sender thread (reply_pump): wait for the final one
    wait_for(lambda: sender.final, timeout=10.0)
    (response, flags), = sender.sent
    assert flags & FINAL
    return response.error


def wait_for(condition, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ---- request parsing ----------------------------------------------------------------
def _get(**inputs):
    return lambda name: inputs.get(name)


def test_defaults_are_documented_ones():
    req = parse_generate_request(_get(text_input=np.array([[b"hi"]], dtype=object)))
    assert (req.prompt, req.max_tokens, req.stream, req.temperature, req.top_p, req.top_k) == \
        ("hi", 16, False, 1.0, 1.0, 0)
    assert (req.seed, req.stop_words, req.end_id, req.exclude_input_in_output) == (None, [], None, False)
    assert (req.bad_words, req.pad_id, req.num_return_sequences, req.repetition_penalty, req.presence_penalty,
            req.frequency_penalty, req.min_tokens, req.length_penalty, req.embedding_bias,
            req.return_log_probs) == ([], None, 1, 1.0, 0.0, 0.0, 0, 1.0, [], False)
    params = req.sampling_params()
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty, params.min_tokens,
            params.bad_words, params.logit_bias, params.logprobs) == (1.0, 0.0, 0.0, 0, [], {}, False)


BAD_SAMPLING = [
    ("max_tokens", 0, np.int32, ">= 1"),
    ("max_tokens", -5, np.int32, ">= 1"),
    ("temperature", -0.5, np.float32, ">= 0"),
    ("temperature", math.nan, np.float32, ">= 0"),
    ("temperature", math.inf, np.float32, ">= 0"),
    ("top_p", 1.5, np.float32, "(0, 1]"),
    ("top_p", 0.0, np.float32, "(0, 1]"),
    ("top_p", -0.1, np.float32, "(0, 1]"),
    ("top_k", -1, np.int32, ">= 0"),
    ("end_id", 100, np.int32, "[0, 99]"),
    ("end_id", -1, np.int32, "[0, 99]"),
    ("pad_id", 100, np.int32, "[0, 99]"),
    ("beam_width", 2, np.int32, "allowed: 1 (Tandem has no beam search"),
    ("beam_width", 0, np.int32, "allowed: 1"),
    ("num_return_sequences", 0, np.int32, "[1, 16]"),
    ("num_return_sequences", 17, np.int32, "[1, 16]"),
    ("repetition_penalty", 0.0, np.float32, "> 0 (1 = off)"),
    ("presence_penalty", 2.5, np.float32, "[-2, 2]"),
    ("frequency_penalty", -3.0, np.float32, "[-2, 2]"),
    ("frequency_penalty", math.nan, np.float32, "[-2, 2]"),
    ("min_tokens", 17, np.int32, "[0, max_tokens=16]"),
    ("min_length", -1, np.int32, "[0, max_tokens=16]"),
    ("length_penalty", math.inf, np.float32, "a finite number"),
    ("return_context_logits", True, np.bool_, "not supported: Tandem returns no context logits; allowed: false"),
    ("return_generation_logits", True, np.bool_, "not supported"),
]


@pytest.mark.parametrize("field,value,dtype,allowed", [
    ("text_input", b"", object, "non-empty"),
    ("text_input", b"\xff\xfe", object, "UTF-8"),
    *BAD_SAMPLING,
])
def test_bad_field_is_named_with_allowed_values(field, value, dtype, allowed):
    inputs = {"text_input": np.array([[b"hi"]], dtype=object), field: np.array([[value]], dtype=dtype)}
    with pytest.raises(RequestError) as err:
        parse_generate_request(inputs.get, vocab_size=VOCAB)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ") and allowed in str(err.value)


@pytest.mark.parametrize("field,value,dtype,allowed", BAD_SAMPLING)
def test_token_requests_share_the_sampling_checks(field, value, dtype, allowed):
    inputs = {"input_ids": np.array([[1, 2]], dtype=np.int32), field: np.array([[value]], dtype=dtype)}
    with pytest.raises(RequestError) as err:
        parse_token_request(inputs.get, VOCAB, CONTEXT)
    assert err.value.field == field and allowed in str(err.value)


@pytest.mark.parametrize("ids,message", [
    (np.zeros((1, 0), dtype=np.int32), "input_ids: is empty"),
    (np.array([[1, 100]], dtype=np.int32), r"input_ids: token id 100 is not in the vocabulary; allowed: ids in \[0, 99\]"),
    (np.array([[-1]], dtype=np.int32), "input_ids: token id -1 is not in the vocabulary"),
    (np.array([[1.0, 2.0]], dtype=np.float32), "input_ids: has type float32; allowed: INT32"),
    (np.array([[1, 2], [3, 4]], dtype=np.int32), r"input_ids: expected one sequence of shape \[1, n\], got shape \[2, 2\]"),
    (np.ones((1, CONTEXT), dtype=np.int32), f"input_ids: has {CONTEXT} tokens; the context is {CONTEXT} tokens"),
    (None, "input_ids: is required"),
])
def test_bad_input_ids_are_named(ids, message):
    with pytest.raises(RequestError, match=f"^{message}"):
        parse_token_request({"input_ids": ids}.get, VOCAB, CONTEXT)


def test_max_tokens_must_fit_the_context_left_by_the_prompt():
    inputs = arrays(input_ids=range(60), max_tokens=5)
    with pytest.raises(RequestError, match=r"^max_tokens: got 5; the prompt has 60 tokens of a 64-token "
                                           r"context; allowed: <= 4$"):
        parse_token_request(inputs.get, VOCAB, CONTEXT)
    assert parse_token_request(arrays(input_ids=range(60), max_tokens=4).get, VOCAB, CONTEXT).prompt == \
        list(range(60))
    check_context(63, 1, CONTEXT, "text_input")
    with pytest.raises(RequestError, match="^text_input: has 64 tokens"):
        check_context(64, 1, CONTEXT, "text_input")


def test_missing_text_and_batched_text_are_rejected():
    with pytest.raises(RequestError, match="text_input: is required"):
        parse_generate_request(_get())
    with pytest.raises(RequestError, match="text_input: expected one value, got 2"):
        parse_generate_request(_get(text_input=np.array([[b"a"], [b"b"]], dtype=object)))


def test_tensorrt_llm_conventions():
    req = parse_generate_request(_get(
        text_input=np.array([[b"hi"]], dtype=object),
        random_seed=np.array([[7]], dtype=np.uint64),          # TensorRT-LLM's name for seed
        stop_words=np.array([[b"\n\n", b"", b"def"]], dtype=object),  # "" pads ragged lists
        end_id=np.array([[5]], dtype=np.int32)))
    assert (req.seed, req.stop_words, req.end_id) == (7, ["\n\n", "def"], 5)
    params = req.sampling_params()
    assert params.stop_token_ids == [5] and params.ignore_eos  # end_id replaces EOS
    assert params.stop == ["\n\n", "def"] and params.seed == 7


def test_every_tensorrt_llm_sampling_input_reaches_the_engine():
    """Each input of the TensorRT-LLM text ensemble maps onto the engine's SamplingParams."""
    req = parse_token_request(arrays(
        input_ids=[1, 2], max_tokens=8, num_return_sequences=3, beam_width=1, seed=2**64 - 2,
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25, min_length=4,
        bad_words=["", "ab", ""], embedding_bias_words=["a", "", "ba"], embedding_bias_weights=[1.5, 9.0, -1.0],
        pad_id=0, length_penalty=0.7, return_log_probs=True, return_num_input_tokens=True,
        return_num_output_tokens=False, return_finish_reason=True).get, VOCAB, CONTEXT)
    assert (req.num_return_sequences, req.length_penalty, req.pad_id) == (3, pytest.approx(0.7), 0)
    p0, p2 = req.sampling_params(0, FakeTokenizer()), req.sampling_params(2, FakeTokenizer())
    assert (p0.seed, p2.seed) == (2**64 - 2, 0)        # seed + i, as a UINT64 wraps
    assert (p0.repetition_penalty, p0.presence_penalty, p0.frequency_penalty) == \
        (pytest.approx(1.3), 0.5, -0.25)
    assert (p0.min_tokens, p0.bad_words, p0.logprobs, p0.max_tokens) == (4, ["ab"], True, 8)
    # every token of a word gets its weight; "" pads; 'a' is 97 % 100, 'b' 98
    assert p0.logit_bias == {97: pytest.approx(0.5), 98: -1.0}
    p0.validate()
    # min_tokens (the newer name) wins over min_length, as seed over random_seed
    both = parse_token_request(arrays(input_ids=[1], min_tokens=2, min_length=5).get, VOCAB, CONTEXT)
    assert both.min_tokens == 2
    with pytest.raises(RequestError, match="embedding_bias_words: this model has no tokenizer"):
        req.sampling_params(0, None)


@pytest.mark.parametrize("extra,message", [
    (dict(embedding_bias_words=["a", "b"], embedding_bias_weights=[1.0]),
     "embedding_bias_weights: has 1 weights for 2 embedding_bias_words; allowed: one weight per word"),
    (dict(embedding_bias_words=["a"]), "embedding_bias_weights: has 0 weights for 1"),
    (dict(embedding_bias_words=["a"], embedding_bias_weights=[math.inf]),
     "embedding_bias_weights: got inf; allowed: finite numbers"),
    (dict(bad_words=["  "]), "bad_words: got '  '; allowed: non-blank strings"),
    (dict(bad_words=["w"] * 17), "bad_words: has 17 words; allowed: up to 16"),
])
def test_word_lists_are_checked(extra, message):
    with pytest.raises(RequestError, match=f"^{re.escape(message)}"):
        parse_token_request(arrays(input_ids=[1], **extra).get, VOCAB, CONTEXT)


def test_engine_replies_have_a_batch_dimension():
    r = SequenceReply([4, 5], "hé", "stop", 3, 2, sequence_index=1, log_probs=[-0.5, -1.0], cum_log_prob=-1.5)
    a = engine_arrays(r)
    assert {k: v.shape for k, v in a.items()} == {
        "output_ids": (1, 2), "text_output": (1, 1), "finish_reason": (1, 1), "num_input_tokens": (1, 1),
        "num_output_tokens": (1, 1), "cum_log_probs": (1, 1), "output_log_probs": (1, 1, 2),
        "sequence_index": (1, 1), **{n: (1, 1) for n in PERF_OUTPUT_NAMES}}
    assert a["text_output"][0, 0].decode() == "hé" and a["num_input_tokens"].dtype == np.uint32
    assert a["output_ids"].dtype == np.int32 and a["output_ids"].tolist() == [[4, 5]]
    assert engine_arrays(SequenceReply([], "", "abort", 3, 0))["output_ids"].shape == (1, 0)


def test_ensemble_responses_are_shaped_as_tensorrt_llm_shapes_them():
    """text_output is one string per row, as TensorRT-LLM's postprocessing returns it:
    its clients read ``as_numpy("text_output")[0].decode()``; the rest as its
    tensorrt_llm model answers ([batch, beam, ...])."""
    r = SequenceReply([4], " x", None, 3, 1, sequence_index=2, log_probs=[-0.25], cum_log_prob=-0.25)
    a = ensemble_arrays(r)
    assert a["text_output"].shape == (1,) and a["text_output"][0].decode() == " x"
    assert {k: v.shape for k, v in a.items() if k != "text_output"} == {
        "finish_reason": (1, 1), "num_input_tokens": (1, 1), "num_output_tokens": (1, 1),
        "cum_log_probs": (1, 1), "output_log_probs": (1, 1, 1), "context_logits": (1, 0, 0),
        "generation_logits": (1, 1, 0, 0), "batch_index": (1, 1), "sequence_index": (1, 1),
        **{n: (1, 1) for n in PERF_OUTPUT_NAMES}}
    assert int(a["sequence_index"][0][0]) == 2 and int(a["batch_index"][0][0]) == 0
    assert "output_ids" not in a and ensemble_arrays(r, with_ids=True)["output_ids"].tolist() == [[4]]


def test_settings_from_config(ckpt_dir):
    s = EngineSettings.from_model_config(model_config(page_size=32, kv_layout="NHD", num_pages=0))
    assert (s.page_size, s.kv_layout, s.engine_num_pages, s.threads) == (32, "NHD", None, 1)
    unrendered = EngineSettings.from_model_config(model_config(dtype="${dtype}"))
    assert unrendered.dtype == "float32"
    with pytest.raises(ValueError, match="kv_layout='XYZ'; allowed: HND, NHD"):
        EngineSettings.from_model_config(model_config(kv_layout="XYZ"))
    with pytest.raises(ValueError, match="page_size='big' is not an integer"):
        EngineSettings.from_model_config(model_config(page_size="big"))
    with pytest.raises(ValueError, match="model_dir is required"):
        EngineSettings.from_model_config({"parameters": {}})
    assert model_limits(ckpt_dir) == (VOCAB, CONTEXT)


# ---- the llm model --------------------------------------------------------------------
def test_initialize_configures_engine_and_threads(model, ckpt_dir):
    import torch
    engine = FakeEngine.instances[-1]
    assert engine.started and engine.model_dir == str(ckpt_dir)
    assert engine.kwargs == dict(dtype="float32", page_size=16, kv_layout="HND", num_pages=None,
                                 max_num_seqs=64, max_num_batched_tokens=512, speculative=None,
                                 enable_prefix_caching=True, model_version="1",
                                 compile="auto", compile_cache_dir=None, enforce_eager=False)
    assert torch.get_num_threads() == 1


def test_speculation_settings_reach_the_engine():
    cfg = {"parameters": {"model_dir": {"string_value": "/m"},
                          "spec_method": {"string_value": "mtp"},
                          "num_speculative_tokens": {"string_value": "2"},
                          "mtp_head": {"string_value": "/heads/mtp"}}}
    spec = EngineSettings.from_model_config(cfg).engine_kwargs()["speculative"]
    assert (spec.method, spec.num_speculative_tokens, spec.mtp_head) == ("mtp", 2, "/heads/mtp")
    cfg["parameters"]["mtp_head"] = {"string_value": ""}
    with pytest.raises(ValueError, match="mtp_head"):
        EngineSettings.from_model_config(cfg)


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
    engine.submit = lambda prompt, params, cb: (submit(prompt, params, cb) if len(engine.submitted) < 1
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
    request = token_request(stream=True, max_tokens=50)
    model.execute([request])
    _, _, on_output = engine.submitted[0]
    on_output(types.SimpleNamespace(request_id="req-0", new_token_ids=[1], new_text=" a", finished=False,
                                    finish_reason=None, num_prompt_tokens=3, num_output_tokens=1))
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


# ---- coalescing: a stream behind its sender gets its steps in one response --------------
def step(i, reason=None, index=0, logprob=None):
    """Engine output of step ``i`` (token 10 + i, text " t<i>")."""
    return types.SimpleNamespace(
        request_id=f"req-{index}", new_token_ids=[10 + i], new_text=f" t{i}", finished=reason is not None,
        finish_reason=reason, num_prompt_tokens=3, num_output_tokens=i + 1,
        new_logprobs=None if logprob is None else [logprob], cumulative_logprob=-0.5 * (i + 1))


def slow_request(**extra):
    request = token_request(**extra)
    request.sender = SlowSender()
    return request


def test_steps_queued_behind_a_busy_sender_arrive_in_one_response_each_token_once(model):
    """The first token goes out at once; the steps made while the server was slow to take
    it come merged in one response: every token once, in order, the counts and finish
    reason of the last step, final on the last response only."""
    engine = FakeEngine.instances[-1]
    request = slow_request(stream=True, max_tokens=5, return_log_probs=True)
    model.execute([request])
    _, _, on_output = engine.submitted[0]
    on_output(step(0, logprob=-0.5))
    assert request.sender.sending.wait(5)           # the first reply is being sent, not held back
    for i in range(1, 5):
        on_output(step(i, reason="length" if i == 4 else None, logprob=-0.5))
    request.sender.release.set()
    assert model.replies.flush()
    sent = outputs(request.sender)
    assert [o["output_ids"].tolist() for o, _ in sent] == [[[10]], [[11, 12, 13, 14]]]
    assert texts(request.sender) == [" t0", " t1 t2 t3 t4"]
    assert [o["finish_reason"][0, 0] for o, _ in sent] == [b"", b"length"]
    assert [int(o["num_output_tokens"][0, 0]) for o, _ in sent] == [1, 5]
    assert sent[1][0]["output_log_probs"].tolist() == [[[-0.5] * 4]]
    assert float(sent[1][0]["cum_log_probs"][0, 0]) == -2.5
    assert [bool(flags & FINAL) for _, flags in sent] == [False, True]
    assert len(model.in_flight) == 0


def test_samples_are_not_merged_with_each_other(model):
    engine = FakeEngine.instances[-1]
    request = slow_request(stream=True, num_return_sequences=2, max_tokens=2)
    model.execute([request])
    on = [engine.submitted[i][2] for i in range(2)]
    on[0](step(0))
    assert request.sender.sending.wait(5)
    on[1](step(0, index=1))
    on[1](step(1, "stop", index=1))      # merges with sample 1's first step
    on[0](step(1, "length"))
    request.sender.release.set()
    assert model.replies.flush()
    sent = outputs(request.sender)
    assert [(int(o["sequence_index"][0, 0]), o["output_ids"].tolist()) for o, _ in sent] == [
        (0, [[10]]), (1, [[10, 11]]), (0, [[11]])]
    assert [bool(flags & FINAL) for _, flags in sent] == [False, False, True]


def test_an_error_after_queued_tokens_comes_after_them(model):
    engine = FakeEngine.instances[-1]
    request = slow_request(stream=True, max_tokens=5)
    model.execute([request])
    _, _, on_output = engine.submitted[0]
    on_output(step(0))
    assert request.sender.sending.wait(5)
    on_output(step(1))
    on_output(step(2, "error"))
    request.sender.release.set()
    assert model.replies.flush()
    assert texts(request.sender) == [" t0", " t1"]
    last, flags = request.sender.sent[-1]
    assert flags & FINAL and last.error.code() == TritonError.INTERNAL


@pytest.mark.parametrize("seed", range(4))
def test_the_pump_delivers_every_reply_once_in_order_whatever_the_timing(seed):
    """Many streams, a sender that takes random time: per stream, the tokens joined are
    the tokens put, in order; one final, last; fewer or as many responses as replies."""
    import random

    from tandem.backends.triton.reply_pump import ReplyPump
    from tandem.backends.triton.response_arrays import SequenceReply
    from tandem.backends.triton.response_stream import Reply

    rng = random.Random(seed)
    pump = ReplyPump()
    got: dict[int, list[Reply]] = {k: [] for k in range(6)}

    def sender(k):
        def send(reply):
            if rng.random() < 0.3:
                time.sleep(0.001)
            got[k].append(reply)
        return send

    boxes = {k: pump.outbox(sender(k)) for k in got}
    lengths = {k: rng.randint(1, 40) for k in got}
    made = {k: 0 for k in got}
    try:
        while any(made[k] < lengths[k] for k in got):
            k = rng.choice([k for k in got if made[k] < lengths[k]])
            i, last = made[k], made[k] == lengths[k] - 1
            boxes[k].put(Reply(sequence=SequenceReply([i], f"<{i}>", "stop" if last else None, 1, i + 1),
                               final=last))
            made[k] += 1
            if rng.random() < 0.2:
                time.sleep(0.0005)
        assert pump.flush()
    finally:
        pump.close()
    for k, replies in got.items():
        assert [t for r in replies for t in r.sequence.token_ids] == list(range(lengths[k]))
        assert "".join(r.sequence.text for r in replies) == "".join(f"<{i}>" for i in range(lengths[k]))
        assert [r.final for r in replies] == [False] * (len(replies) - 1) + [True]
        assert replies[-1].sequence.num_output_tokens == lengths[k]
    assert pump.sent <= pump.replies == sum(lengths.values())


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
    from tandem.backends.triton.response_arrays import ENGINE_OUTPUT_NAMES

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
    for (a, _), (b, _) in zip(outputs(lean.sender), outputs(full.sender), strict=True):
        assert set(a) == (set(ENGINE_OUTPUT_NAMES) | {"cancel_token", "prompt_echo"}) - left_out
        b = {**b, "prompt_echo": np.array([[flags["prompt_echo"].encode()]], dtype=object)}
        a_out, b_out = ensemble_outputs(a.get), ensemble_outputs(b.get)
        assert a_out.keys() == b_out.keys()
        for name in a_out:
            assert a_out[name].tolist() == b_out[name].tolist(), name


def test_postprocess_is_not_dynamically_batched():
    """Triton's dynamic batcher finishes a cancelled request without executing it, so a
    batched postprocess would never see the client's cancellation it carries to the
    engine (an e2e cancellation test caught it: the engine never aborted)."""
    from pathlib import Path

    config = (Path(__file__).resolve().parents[3] / "model_repository/postprocess/config.pbtxt").read_text()
    lines = [line.split("#")[0] for line in config.splitlines()]
    assert not any("dynamic_batching" in line for line in lines)
    assert "max_batch_size: 1" in lines


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


# ---- postprocess, and cancellation through an ensemble ----------------------------------
def reply(**extra):
    """An engine reply as postprocess receives it."""
    return arrays(text_output=" b", finish_reason="", num_input_tokens=3, num_output_tokens=1, **extra)


@pytest.mark.parametrize("stream,exclude,echo", [
    (None, None, "a ="),        # the defaults: not streaming, prompt included (TensorRT-LLM)
    (False, False, "a ="),
    (False, True, ""),
    (True, False, ""),          # streaming never repeats the prompt
    (True, True, ""),
])
def test_the_prompt_is_echoed_only_in_a_whole_non_streaming_text(stream, exclude, echo):
    from tandem.backends.triton.postprocess import prompt_echo

    flags = {k: v for k, v in (("stream", stream), ("exclude_input_in_output", exclude)) if v is not None}
    assert prompt_echo(parse_generate_request(arrays(text_input="a =", **flags).get)) == echo
    assert prompt_echo(parse_token_request(arrays(input_ids=[1], **flags).get, VOCAB, CONTEXT)) == ""


def test_postprocess_puts_the_relayed_echo_first():
    from tandem.backends.triton.postprocess import ensemble_outputs

    out = ensemble_outputs(reply(prompt_echo="a =").get)
    assert out["text_output"][0].decode() == "a = b"
    assert set(out) == set(OUTPUT_NAMES)
    assert (out["finish_reason"][0, 0], int(out["num_output_tokens"][0, 0])) == (b"", 1)
    assert ensemble_outputs(reply(prompt_echo="").get)["text_output"][0] == b" b"


def test_postprocess_passes_log_probs_and_the_sequence_index_on():
    from tandem.backends.triton.postprocess import ensemble_outputs

    out = ensemble_outputs(reply(sequence_index=1, cum_log_probs=-0.75, output_log_probs=[-0.25, -0.5]).get)
    assert int(out["sequence_index"][0, 0]) == 1 and float(out["cum_log_probs"][0, 0]) == -0.75
    assert out["output_log_probs"].tolist() == [[[-0.25, -0.5]]]


def test_postprocess_passes_token_ids_on_and_needs_no_echo():
    from tandem.backends.triton.postprocess import ensemble_outputs

    out = ensemble_outputs(reply().get)   # tandem_tokens: no echo
    assert out["text_output"][0] == b" b" and "output_ids" not in out
    out = ensemble_outputs({**reply(), "output_ids": np.array([[7, 8]], dtype=np.int32)}.get)
    assert out["output_ids"].tolist() == [[7, 8]] and set(out) == set(TOKEN_OUTPUT_NAMES)
    with pytest.raises(RequestError, match="^text_output: is required"):
        ensemble_outputs({}.get)


def test_cancel_channel_delivers_only_issued_well_formed_tokens():
    from tandem.backends.triton.cancel_channel import CancelListener, send_cancel

    got = []
    pid = 10**9 + uuid.uuid4().int % 10**6      # no real server: a pid of our own
    listener = CancelListener("decode_0_0.1", got.append, server_pid=pid)
    try:
        nonce, token = listener.new_token()
        assert token == f"decode_0_0.1/{nonce}".encode() and len(nonce) == 32
        assert send_cancel(token, server_pid=pid)
        wait_for(lambda: got == [nonce])
        for bad in (b"", b"decode_0_0.1/xyz", b"../x/" + nonce.encode(), token + b"\n"):
            assert not send_cancel(bad, server_pid=pid)
        assert not send_cancel(token, server_pid=pid + 1)       # no listener there
        import socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:  # garbage is dropped
            s.sendto(b"\x00" * 40, f"\0tandem-cancel-{pid}-decode_0_0.1")
        assert send_cancel(token, server_pid=pid)
        wait_for(lambda: got == [nonce, nonce])
    finally:
        listener.close()
    with pytest.raises(ValueError, match="cancel endpoint"):
        CancelListener("a/b", got.append, server_pid=pid)


def test_cancellation_is_never_asked_while_or_after_the_final_reply_goes_out():
    """The Python backend frees a decoupled request's response factory with its final
    response; ``is_cancelled()`` after that crashed the server (use after free)."""
    import threading

    from tandem.backends.triton.generate_request import GenerateRequest
    from tandem.backends.triton.response_stream import ResponseStream

    sending, release = threading.Event(), threading.Event()

    def slow_send(reply):
        sending.set()
        release.wait(5)

    stream = ResponseStream(GenerateRequest([1], stream=True), slow_send)
    asked = []
    assert stream.client_cancelled(lambda: asked.append(1) or False) is False and asked == [1]
    final = threading.Thread(target=stream.fail, args=("boom",))
    final.start()
    sending.wait(5)
    answer = []
    poll = threading.Thread(target=lambda: answer.append(stream.client_cancelled(lambda: asked.append(2))))
    poll.start()
    time.sleep(0.05)
    assert answer == []              # waits for the final send to finish
    release.set()
    final.join(5)
    poll.join(5)
    assert answer == [False] and asked == [1]


def test_in_flight_applies_a_cancellation_that_comes_before_submit_returns():
    from tandem.backends.triton.generate_request import GenerateRequest
    from tandem.backends.triton.in_flight import InFlight
    from tandem.backends.triton.response_stream import ResponseStream

    engine = FakeEngine("/x")
    in_flight = InFlight(engine, poll_s=0.005)
    try:
        sent = []
        early = ResponseStream(GenerateRequest([1], stream=True), sent.append)
        in_flight.add("k1", Request(), early)
        assert in_flight.cancel("k1") and early.closed and sent[-1].code == "CANCELLED"
        assert engine.aborted == []                  # no engine request id yet
        in_flight.started("k1", "req-7")
        assert engine.aborted == ["req-7"]
        in_flight.submitted("k1")
        assert len(in_flight) == 0
        assert not in_flight.cancel("k1") and not in_flight.cancel("unknown")

        late = ResponseStream(GenerateRequest([1], stream=True), sent.append)
        in_flight.add("k2", Request(), late)
        in_flight.started("k2", "req-8")
        in_flight.submitted("k2")
        assert in_flight.cancel("k2") and engine.aborted == ["req-7", "req-8"]
        assert len(in_flight) == 0
    finally:
        in_flight.close("bye")


def test_a_stream_that_ended_aborts_its_unfinished_sequences_once():
    """The submitting thread and the cancel watcher may both see a stream close (a
    sibling was refused): its running sequences are aborted once, not once per observer."""
    from tandem.backends.triton.generate_request import GenerateRequest
    from tandem.backends.triton.in_flight import InFlight
    from tandem.backends.triton.response_stream import ResponseStream

    engine = FakeEngine("/x")
    in_flight = InFlight(engine, poll_s=3600)      # the watcher stays asleep: ended() by hand
    try:
        stream = ResponseStream(GenerateRequest([1], stream=True, num_return_sequences=2), [].append)
        in_flight.add("k", Request(), stream)
        in_flight.started("k", "req-0", 0)
        assert stream.fail("the pool is too small")
        in_flight.ended("k")             # the submitting thread
        in_flight.ended("k")             # the watcher, before submitted() forgets the entry
        in_flight.submitted("k")
        assert engine.aborted == ["req-0"] and len(in_flight) == 0
    finally:
        in_flight.close("bye")


def test_a_cancelled_ensemble_request_reaches_the_engine_through_postprocess(model, pb_utils):
    """Triton cancels the postprocess step that follows a cancelled ensemble, not the engine
    step in flight: postprocess must hand the reply's cancel token back to the llm model."""
    from tandem.backends.triton.postprocess_model import TritonPythonModel as Postprocess

    engine = FakeEngine.instances[-1]
    request = token_request(stream=True, max_tokens=50, prompt_echo="x: ")
    model.execute([request])
    _, _, on_output = engine.submitted[0]
    on_output(types.SimpleNamespace(request_id="req-0", new_token_ids=[1], new_text=" a", finished=False,
                                    finish_reason=None, num_prompt_tokens=3, num_output_tokens=1))
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


# ---- the prefill model: its adapter picks the role -----------------------------------

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
