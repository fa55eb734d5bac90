"""The ``tandem`` Triton model: a decoupled streaming front of the engine.

``model_repository/tandem/1/model.py`` re-exports :class:`TritonPythonModel`.
The request format lives in :mod:`.generate_request`, the response rules in
:mod:`.response_stream`; this module is the ``pb_utils`` glue:

- ``execute`` parses each request, submits it to the engine and returns at
  once; the engine thread sends responses through the request's sender.
- A watcher thread polls ``request.is_cancelled()`` for in-flight requests
  (only while there are any, so an idle instance uses no CPU), sends the
  final cancelled response and aborts the sequence in the engine.
- ``finalize`` ends every open stream and shuts the engine down.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import signal
import sys
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils

from .generate_request import OUTPUT_NAMES, RequestError, parse_generate_request
from .response_stream import Reply, ResponseStream
from .settings import EngineSettings

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Metrics:
    """Custom metrics on Triton's metrics port (``/metrics``)."""

    REASONS = ("stop", "length", "abort", "error", "rejected")

    def __init__(self, model: str, version: str):
        labels = {"model": model, "version": version}
        # the families must stay referenced for their metrics to live
        self.families = [
            pb_utils.MetricFamily(name="tandem_requests_in_engine",
                                  description="requests submitted to the engine and not yet finished by it",
                                  kind=pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily(name="tandem_requests_finished_total",
                                  description="requests ended, by finish reason (rejected: invalid input)",
                                  kind=pb_utils.MetricFamily.COUNTER),
        ]
        self.in_engine = self.families[0].Metric(labels=labels)
        self.finished = {r: self.families[1].Metric(labels={**labels, "reason": r}) for r in self.REASONS}

    def submitted(self) -> None:
        self.in_engine.increment(1)

    def not_submitted(self) -> None:
        self.in_engine.increment(-1)

    def engine_finished(self, reason: str | None) -> None:
        self.in_engine.increment(-1)
        self.finish(reason or "stop")

    def finish(self, reason: str) -> None:
        metric = self.finished.get(reason)
        if metric is not None:
            metric.increment(1)


def _log(level: str, message: str) -> None:
    logger = pb_utils.Logger
    getattr(logger, f"log_{level}")(f"[tandem] {message}")


class _InFlight:
    """Open streams by engine request id, plus the cancellation watcher."""

    def __init__(self, engine, poll_s: float):
        self._engine = engine
        self._poll_s = poll_s
        self._streams: dict[str, tuple[object, ResponseStream]] = {}
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="tandem-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, rid: str, request, stream: ResponseStream) -> None:
        with self._cv:
            if not stream.closed:  # it may have finished before submit returned
                self._streams[rid] = (request, stream)
                self._cv.notify()

    def discard(self, rid: str) -> None:
        with self._cv:
            self._streams.pop(rid, None)

    def _watch(self) -> None:
        while True:
            with self._cv:
                while not self._streams and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
            self._poll_once()
            with self._cv:
                if not self._stopping:
                    self._cv.wait(self._poll_s)

    def _poll_once(self) -> None:
        # A method of its own so that no request object stays referenced from
        # this thread's locals while it sleeps.
        with self._cv:
            snapshot = list(self._streams.items())
        for rid, (request, stream) in snapshot:
            if stream.closed:
                self.discard(rid)
                continue
            try:
                cancelled = request.is_cancelled()
            except Exception:  # the request is gone on the server side
                cancelled = True
            if cancelled and stream.cancel():
                self.discard(rid)
                self._engine.abort(rid)

    def close(self, message: str) -> None:
        """End every open stream with ``message`` and stop the watcher."""
        with self._cv:
            self._stopping = True
            streams = list(self._streams.items())
            self._streams.clear()
            self._cv.notify_all()
        for rid, (_, stream) in streams:
            if stream.fail(message, code="UNAVAILABLE"):
                self._engine.abort(rid)
        self._thread.join(timeout=5)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import torch

        # `kill -USR1 <stub pid>` dumps every thread's stack into the server log.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "model 'tandem' streams tokens and must be decoupled: "
                "set model_transaction_policy { decoupled: true } in config.pbtxt")
        self.settings = EngineSettings.from_model_config(model_config)
        torch.set_num_threads(self.settings.threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set in this process
            pass

        s = self.settings
        self.engine = self._make_engine(s)
        if self.engine.tokenizer is None:
            raise pb_utils.TritonModelException(
                f"model_dir {s.model_dir} has no tokenizer.json; the tandem model takes text")
        self.vocab_size = self.engine.tokenizer.get_vocab_size()
        self.engine.start()
        self.in_flight = _InFlight(self.engine, s.cancel_poll_ms / 1000.0)
        self.metrics = _Metrics(args.get("model_name", "tandem"), str(args.get("model_version", "1")))
        _log("info", f"engine ready: {s.model_dir} dtype={s.dtype} page_size={s.page_size} "
                     f"kv_layout={s.kv_layout} torch_threads={s.threads}")

    def _make_engine(self, s: EngineSettings):
        """The engine this model streams from (the decode model puts it on the shared pool)."""
        from tandem.backends.engine.async_engine import AsyncEngine

        return AsyncEngine(s.model_dir, **s.engine_kwargs())

    def _submit(self, request, parsed, on_output) -> str:
        """Hand a parsed request to the engine; returns its engine request id."""
        return self.engine.submit(parsed.prompt, parsed.sampling_params(), on_output)

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None  # decoupled: responses go through each request's sender

    def _start(self, request) -> None:
        sender = request.get_response_sender()

        def get(name: str):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        try:
            parsed = parse_generate_request(get, vocab_size=self.vocab_size)
        except RequestError as exc:
            _send_error(sender, str(exc))
            self.metrics.finish("rejected")
            return

        stream = ResponseStream(parsed, lambda reply: _send(sender, reply))
        in_flight, metrics = self.in_flight, self.metrics

        def on_output(out) -> None:  # engine thread
            try:
                if out.finished:
                    metrics.engine_finished(out.finish_reason)
                stream.on_output(out)
            except Exception as exc:
                _log("error", f"response failed: {traceback.format_exc()}")
                if stream.fail(f"internal error: {exc}", code="INTERNAL"):
                    self.engine.abort(out.request_id)
            if stream.closed:
                in_flight.discard(out.request_id)

        metrics.submitted()  # before submit: the engine may finish the request before it returns
        try:
            rid = self._submit(request, parsed, on_output)
        except Exception as exc:
            metrics.not_submitted()
            if isinstance(exc, ValueError):  # the engine's own validation (prompt too long, ...)
                stream.fail(str(exc))
                metrics.finish("rejected")
            else:
                _log("error", f"submit failed: {traceback.format_exc()}")
                stream.fail(f"internal error: {exc}", code="INTERNAL")
                metrics.finish("error")
            return
        in_flight.add(rid, request, stream)

    def finalize(self) -> None:
        start = time.monotonic()
        in_flight = getattr(self, "in_flight", None)
        if in_flight is not None:
            in_flight.close("the server is shutting down; request aborted")
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        # metric objects must die while the stub can still talk to the server: left to
        # interpreter teardown they are destroyed after its IPC is gone and crash the stub
        self.metrics = None
        gc.collect()
        _log("info", f"finalized in {time.monotonic() - start:.2f} s")


def _send_error(sender, message: str) -> None:
    _send(sender, Reply(error=message, final=True))


def _error_code(code: str):
    return getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)


def _send(sender, reply: Reply) -> None:
    if reply.error is not None:
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(reply.error, _error_code(reply.code)))
    elif reply.outputs is not None:
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, reply.outputs[name]) for name in OUTPUT_NAMES])
    else:
        response = None
    try:
        if response is None:
            sender.send(flags=FINAL)
        else:
            sender.send(response, flags=FINAL if reply.final else 0)
    except Exception as exc:  # the client went away; the watcher sees the cancellation
        _log("verbose", f"response not delivered: {exc}")

