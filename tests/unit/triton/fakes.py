"""Stand-ins for Triton's adapters' tests without a server: ``triton_python_backend_utils``
(which exists only inside the Python backend's stub; TensorRT-LLM's tests replace it the
same way) and a fake engine in place of AsyncEngine, whose outputs a test drives by hand."""

from __future__ import annotations

import os
import time
import types

import numpy as np

VOCAB, CONTEXT = 100, 64    # the fake checkpoint's (see ckpt_dir)

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


class SlowSender(Sender):
    """A sender whose first ``send`` blocks until ``release`` is set: the server is slow
    to take a response, so the stream falls behind."""

    def __init__(self):
        import threading
        super().__init__()
        self.sending, self.release = threading.Event(), threading.Event()

    def send(self, response=None, flags=0):
        if not self.sent:
            self.sending.set()
            assert self.release.wait(5), "never released"
        super().send(response, flags)


class Request:
    def __init__(self, request_id: str = "", **inputs):
        self.inputs = {k: Tensor(k, v) for k, v in inputs.items()}
        self.sender = Sender()
        self.cancelled = False
        self.id = request_id

    def request_id(self):
        return self.id

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return self.cancelled


class TritonModelException(Exception):
    pass


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"
    values: dict[tuple, float] = {}
    busy: list[bool] = [False]
    overlaps: list[int] = [0]      # updates that ran while another was under way

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):
        key = (self.name, tuple(sorted(labels.items())))
        family_values, busy, overlaps = MetricFamily.values, MetricFamily.busy, MetricFamily.overlaps

        class _Metric:
            # the real one releases the GIL and rewrites a shared-memory message: one at a time
            def increment(self, value):
                if busy[0]:
                    overlaps[0] += 1
                busy[0] = True
                time.sleep(0.0002)
                family_values[key] = family_values.get(key, 0) + value
                busy[0] = False

            def set(self, value):
                family_values[key] = value

            def observe(self, value):   # a histogram: its count, as Prometheus's _count
                self.increment(1)
        return _Metric()


def metric(name, **labels):
    """The value of this process's series (every metric carries its incarnation: the pid)."""
    labels = {"model": "llm", "version": "1", "incarnation": str(os.getpid()), **labels}
    return MetricFamily.values.get((name, tuple(sorted(labels.items()))), 0)


def stand_in_pb_utils() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor, m.TritonError, m.InferenceResponse = Tensor, TritonError, InferenceResponse
    m.TritonModelException = TritonModelException
    m.MetricFamily = MetricFamily
    MetricFamily.values, MetricFamily.busy, MetricFamily.overlaps = {}, [False], [0]
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
        return VOCAB

    def encode(self, text, add_special_tokens=True):
        """One token per character (its code point, modulo the vocabulary)."""
        return types.SimpleNamespace(ids=[ord(c) % VOCAB for c in text])


class FakeEngine:
    instances: list["FakeEngine"] = []

    def __init__(self, model_dir, **kwargs):
        self.model_dir, self.kwargs = model_dir, kwargs
        self.tokenizer = FakeTokenizer()
        self.submitted: list[tuple[list[int], object, object]] = []
        self.loras: list = []         # each submitted request's LoRARequest (None: the base)
        self.aborted: list[str] = []
        self.started = self.stopped = False
        self.reject: str | None = None
        # what the metrics poller reads: no speculation, (free, used) pages
        self.spec_metrics, self.kv_pages = None, (30, 2)
        self.flush = None      # the model's reply sender: emit() returns once its replies went out
        FakeEngine.instances.append(self)

    def start(self):
        self.started = True

    def submit(self, prompt, params, on_output, lora=None):
        if self.reject:
            raise ValueError(self.reject)
        params.validate()
        rid = f"req-{len(self.submitted)}"
        self.submitted.append((prompt, params, on_output))
        self.loras.append(lora)
        return rid

    def abort(self, rid):
        self.aborted.append(rid)

    def shutdown(self):
        self.stopped = True

    def emit(self, index, texts, reason="length", prompt_tokens=3, logprobs=None):
        """Deliver one output per text (token id 10 + i, log prob ``logprobs[i]`` when
        given); the last finishes with ``reason``."""
        _, _, on_output = self.submitted[index]
        cum = 0.0
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            lp = None if logprobs is None else [logprobs[i]]
            cum += 0.0 if lp is None else lp[0]
            on_output(types.SimpleNamespace(
                request_id=f"req-{index}", new_token_ids=[10 + i], new_text=text, finished=last,
                finish_reason=reason if last else None, num_prompt_tokens=prompt_tokens,
                num_output_tokens=i + 1, new_logprobs=lp, cumulative_logprob=cum))
            if self.flush is not None:
                self.flush()   # one response per step, as when the sender keeps up
