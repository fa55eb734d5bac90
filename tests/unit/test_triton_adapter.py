"""The tandem Triton model without a server.

``triton_python_backend_utils`` only exists inside the Python backend stub, so
(as TensorRT-LLM's tests do) a stand-in module replaces it, and a fake engine
stands in for AsyncEngine: the tests drive its outputs by hand.
"""

from __future__ import annotations

import json
import math
import sys
import time
import types

import numpy as np
import pytest

from tandem.backends.triton.generate_request import (
    RequestError, output_arrays, parse_generate_request)
from tandem.backends.triton.settings import EngineSettings

FINAL = 1


# ---- stand-in for triton_python_backend_utils -----------------------------------
class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class TritonError:
    INVALID_ARG, CANCELLED, INTERNAL, UNAVAILABLE = "INVALID_ARG", "CANCELLED", "INTERNAL", "UNAVAILABLE"

    def __init__(self, message, code=INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors or []}
        self.error = error


class Sender:
    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []

    def send(self, response=None, flags=0):
        assert not any(f & FINAL for _, f in self.sent), "response sent after the final flag"
        self.sent.append((response, flags))

    @property
    def final(self) -> bool:
        return bool(self.sent) and bool(self.sent[-1][1] & FINAL)


class Request:
    def __init__(self, **inputs):
        self.inputs = {k: Tensor(k, v) for k, v in inputs.items()}
        self.sender = Sender()
        self.cancelled = False

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return self.cancelled


class TritonModelException(Exception):
    pass


class MetricFamily:
    COUNTER, GAUGE = "COUNTER", "GAUGE"
    values: dict[tuple, float] = {}

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):
        key = (self.name, tuple(sorted(labels.items())))
        family_values = MetricFamily.values

        class _Metric:
            def increment(self, value):
                family_values[key] = family_values.get(key, 0) + value

            def set(self, value):
                family_values[key] = value
        return _Metric()


def metric(name, **labels):
    labels = {"model": "tandem", "version": "1", **labels}
    return MetricFamily.values.get((name, tuple(sorted(labels.items()))), 0)


def _stand_in_pb_utils() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor, m.TritonError, m.InferenceResponse = Tensor, TritonError, InferenceResponse
    m.TritonModelException = TritonModelException
    m.MetricFamily = MetricFamily
    MetricFamily.values = {}
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    m.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    m.using_decoupled_model_transaction_policy = lambda cfg: cfg.get(
        "model_transaction_policy", {}).get("decoupled", False)
    m.Logger = types.SimpleNamespace(**{f"log_{lvl}": (lambda msg: None)
                                        for lvl in ("info", "warn", "error", "verbose")})
    return m


# ---- a fake engine ----------------------------------------------------------------
class FakeTokenizer:
    def get_vocab_size(self):
        return 100


class FakeEngine:
    instances: list["FakeEngine"] = []

    def __init__(self, model_dir, **kwargs):
        self.model_dir, self.kwargs = model_dir, kwargs
        self.tokenizer = FakeTokenizer()
        self.submitted: list[tuple[str, object, object]] = []
        self.aborted: list[str] = []
        self.started = self.stopped = False
        self.reject: str | None = None
        FakeEngine.instances.append(self)

    def start(self):
        self.started = True

    def submit(self, prompt, params, on_output):
        if self.reject:
            raise ValueError(self.reject)
        params.validate()
        rid = f"req-{len(self.submitted)}"
        self.submitted.append((prompt, params, on_output))
        return rid

    def abort(self, rid):
        self.aborted.append(rid)

    def shutdown(self):
        self.stopped = True

    def emit(self, index, texts, reason="length", prompt_tokens=3):
        """Deliver one output per text; the last finishes with ``reason``."""
        _, _, on_output = self.submitted[index]
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            on_output(types.SimpleNamespace(
                request_id=f"req-{index}", new_token_ids=[10 + i], new_text=text, finished=last,
                finish_reason=reason if last else None, num_prompt_tokens=prompt_tokens,
                num_output_tokens=i + 1))


def model_config(decoupled=True, **params):
    params = {"model_dir": "/ckpt", "torch_threads": "1", "cancel_poll_ms": "5", **params}
    return {"name": "tandem", "model_transaction_policy": {"decoupled": decoupled},
            "parameters": {k: {"string_value": str(v)} for k, v in params.items()}}


@pytest.fixture
def model_cls(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in_pb_utils())
    monkeypatch.delitem(sys.modules, "tandem.backends.triton.llm_model", raising=False)
    import tandem.backends.engine.async_engine as async_engine
    monkeypatch.setattr(async_engine, "AsyncEngine", FakeEngine)
    from tandem.backends.triton.llm_model import TritonPythonModel
    return TritonPythonModel


@pytest.fixture
def model(model_cls):
    import torch
    threads = torch.get_num_threads()
    m = model_cls()
    m.initialize({"model_config": json.dumps(model_config()), "model_name": "tandem", "model_version": "1"})
    yield m
    m.finalize()
    torch.set_num_threads(threads)


def text_request(text="def f():", **extra):
    inputs = {"text_input": np.array([[text.encode()]], dtype=object)}
    types_ = {"max_tokens": np.int32, "top_k": np.int32, "end_id": np.int32, "temperature": np.float32,
              "top_p": np.float32, "seed": np.uint64, "random_seed": np.uint64, "stream": np.bool_,
              "exclude_input_in_output": np.bool_}
    for k, v in extra.items():
        if k == "stop_words":
            inputs[k] = np.array([[w.encode() for w in v]], dtype=object)
        else:
            inputs[k] = np.array([[v]], dtype=types_[k])
    return Request(**inputs)


def outputs(sender):
    return [(r.outputs, flags) for r, flags in sender.sent if r is not None and r.error is None]


def texts(sender):
    return [o["text_output"].reshape(-1)[0].decode() for o, _ in outputs(sender)]


def the_error(sender):
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


@pytest.mark.parametrize("field,value,dtype,allowed", [
    ("text_input", b"", object, "non-empty"),
    ("text_input", b"\xff\xfe", object, "UTF-8"),
    ("max_tokens", 0, np.int32, ">= 1"),
    ("max_tokens", -5, np.int32, ">= 1"),
    ("temperature", -0.5, np.float32, ">= 0"),
    ("temperature", math.nan, np.float32, ">= 0"),
    ("temperature", math.inf, np.float32, ">= 0"),
    ("top_p", 1.5, np.float32, "[0, 1]"),
    ("top_p", -0.1, np.float32, "[0, 1]"),
    ("top_k", -1, np.int32, ">= 0"),
    ("end_id", 100, np.int32, "[0, 99]"),
    ("end_id", -1, np.int32, ">= 0"),
])
def test_bad_field_is_named_with_allowed_values(field, value, dtype, allowed):
    inputs = {"text_input": np.array([[b"hi"]], dtype=object), field: np.array([[value]], dtype=dtype)}
    with pytest.raises(RequestError) as err:
        parse_generate_request(inputs.get, vocab_size=100)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ") and allowed in str(err.value)


def test_missing_text_and_batched_text_are_rejected():
    with pytest.raises(RequestError, match="text_input: is required"):
        parse_generate_request(_get())
    with pytest.raises(RequestError, match="text_input: expected one value, got 2"):
        parse_generate_request(_get(text_input=np.array([[b"a"], [b"b"]], dtype=object)))


def test_tensorrt_llm_conventions():
    req = parse_generate_request(_get(
        text_input=np.array([[b"hi"]], dtype=object),
        top_p=np.array([[0.0]], dtype=np.float32),             # 0 disables nucleus filtering
        random_seed=np.array([[7]], dtype=np.uint64),          # TensorRT-LLM's name for seed
        stop_words=np.array([[b"\n\n", b"", b"def"]], dtype=object),  # "" pads ragged lists
        end_id=np.array([[5]], dtype=np.int32)))
    assert (req.top_p, req.seed, req.stop_words, req.end_id) == (1.0, 7, ["\n\n", "def"], 5)
    params = req.sampling_params()
    assert params.stop_token_ids == [5] and params.ignore_eos  # end_id replaces EOS
    assert params.stop == ["\n\n", "def"] and params.seed == 7


def test_output_arrays_have_a_batch_dimension():
    arrays = output_arrays("hé", "stop", 3, 2)
    assert {k: v.shape for k, v in arrays.items()} == {k: (1, 1) for k in arrays}
    assert arrays["text_output"][0, 0].decode() == "hé"
    assert arrays["num_input_tokens"].dtype == np.uint32


def test_settings_from_config():
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


# ---- the model ------------------------------------------------------------------------
def test_initialize_configures_engine_and_threads(model):
    import torch
    engine = FakeEngine.instances[-1]
    assert engine.started and engine.model_dir == "/ckpt"
    assert engine.kwargs == dict(dtype="float32", page_size=16, kv_layout="HND", num_pages=None,
                                 max_num_seqs=64, max_num_batched_tokens=512, speculative=None)
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


def test_not_decoupled_is_refused(model_cls):
    with pytest.raises(TritonModelException, match="decoupled"):
        model_cls().initialize({"model_config": json.dumps(model_config(decoupled=False))})


def test_streaming_sends_one_response_per_step_then_final(model):
    request = text_request(stream=True, max_tokens=3, temperature=0.0)
    assert model.execute([request]) is None
    engine = FakeEngine.instances[-1]
    prompt, params, _ = engine.submitted[0]
    assert prompt == "def f():" and params.max_tokens == 3 and params.temperature == 0.0
    engine.emit(0, [" a", " b", " c"], reason="length")
    sent = outputs(request.sender)
    assert texts(request.sender) == [" a", " b", " c"]  # the prompt is never streamed
    assert [bool(flags & FINAL) for _, flags in sent] == [False, False, True]
    assert [o["finish_reason"][0, 0] for o, _ in sent] == [b"", b"", b"length"]
    assert [int(o["num_output_tokens"][0, 0]) for o, _ in sent] == [1, 2, 3]
    assert int(sent[-1][0]["num_input_tokens"][0, 0]) == 3
    assert metric("tandem_requests_in_engine") == 0
    assert metric("tandem_requests_finished_total", reason="length") == 1


@pytest.mark.parametrize("exclude", [False, True])
def test_non_streaming_sends_the_whole_text_once(model, exclude):
    request = text_request("x = ", exclude_input_in_output=exclude)
    model.execute([request])
    FakeEngine.instances[-1].emit(0, ["1", "", "2"], reason="stop")
    (out, flags), = outputs(request.sender)
    assert flags & FINAL
    assert texts(request.sender) == ["12" if exclude else "x = 12"]
    assert out["finish_reason"][0, 0] == b"stop"


def test_bad_input_gets_an_error_response_and_never_reaches_the_engine(model):
    request = text_request(max_tokens=0)
    model.execute([request])
    error = the_error(request.sender)
    assert error.code() == TritonError.INVALID_ARG
    assert error.message() == "max_tokens: got 0; allowed: an integer >= 1"
    assert FakeEngine.instances[-1].submitted == []
    assert metric("tandem_requests_finished_total", reason="rejected") == 1


def test_engine_rejection_is_returned_as_error(model):
    FakeEngine.instances[-1].reject = "prompt (9 tokens) + max_tokens (9000) exceeds the context"
    request = text_request(max_tokens=9000)
    model.execute([request])
    assert "exceeds the context" in the_error(request.sender).message()
    assert metric("tandem_requests_in_engine") == 0


def test_one_bad_request_does_not_affect_the_others(model):
    good, bad = text_request(stream=True), text_request("")
    model.execute([bad, good])
    FakeEngine.instances[-1].emit(0, ["ok"])
    assert "text_input" in the_error(bad.sender).message()
    assert texts(good.sender) == ["ok"] and good.sender.final


def test_cancelled_request_gets_final_and_is_aborted(model):
    engine = FakeEngine.instances[-1]
    request = text_request(stream=True, max_tokens=100)
    model.execute([request])
    _, _, on_output = engine.submitted[0]
    on_output(types.SimpleNamespace(request_id="req-0", new_token_ids=[1], new_text=" a", finished=False,
                                    finish_reason=None, num_prompt_tokens=3, num_output_tokens=1))
    request.cancelled = True
    wait_for(lambda: engine.aborted == ["req-0"])
    assert request.sender.final
    response, _ = request.sender.sent[-1]
    assert response.error.code() == TritonError.CANCELLED
    # the engine's own abort output arrives later and is dropped (Sender asserts nothing follows FINAL)
    on_output(types.SimpleNamespace(request_id="req-0", new_token_ids=[], new_text="", finished=True,
                                    finish_reason="abort", num_prompt_tokens=3, num_output_tokens=1))
    assert texts(request.sender) == [" a"]
    assert metric("tandem_requests_finished_total", reason="abort") == 1
    assert metric("tandem_requests_in_engine") == 0


def test_finished_requests_are_not_polled(model):
    engine = FakeEngine.instances[-1]
    request = text_request()
    model.execute([request])
    engine.emit(0, ["done"])
    request.cancelled = True  # after the fact: nothing more may be sent, nothing aborted
    time.sleep(0.05)
    assert engine.aborted == [] and len(request.sender.sent) == 1


def test_engine_failure_ends_the_stream_with_an_error(model):
    request = text_request(stream=True)
    model.execute([request])
    FakeEngine.instances[-1].emit(0, ["a", ""], reason="error")
    assert texts(request.sender) == ["a"]
    response, flags = request.sender.sent[-1]
    assert flags & FINAL and response.error.code() == TritonError.INTERNAL


def test_finalize_ends_open_streams_and_stops_the_engine(model_cls):
    m = model_cls()
    m.initialize({"model_config": json.dumps(model_config())})
    engine = FakeEngine.instances[-1]
    request = text_request(stream=True)
    m.execute([request])
    m.finalize()
    assert engine.stopped and engine.aborted == ["req-0"]
    response, flags = request.sender.sent[-1]
    assert flags & FINAL and response.error.code() == TritonError.UNAVAILABLE


def test_only_backends_triton_imports_pb_utils():
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    imports = re.compile(r"^\s*(import|from)\s+triton_python_backend_utils\b", re.M)
    offenders = [
        str(p.relative_to(root)) for folder in ("backends", "rdma", "client")
        for p in (root / folder).rglob("*.py")
        if imports.search(p.read_text()) and p.parent != root / "backends" / "triton"
    ]
    assert offenders == []
