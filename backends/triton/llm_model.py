"""The ``llm`` Triton model: the engine's decoupled, token-level streaming front.

``model_repository/llm/1/model.py`` re-exports :class:`TritonPythonModel`; the
``decode`` model (:mod:`.decode_model`) is this model on the shared decode pool.
Inputs are ``input_ids`` and the sampling inputs, outputs ``output_ids`` and the
detokenized delta (:mod:`.generate_request`); in an ensemble it also relays
``prompt_echo`` unread to postprocess (:mod:`.postprocess`). The response rules live in
:mod:`.response_stream`, stream bookkeeping in :mod:`.in_flight`. This module is
the ``pb_utils`` glue:

- ``execute`` parses each request, submits it to the engine and returns at
  once; the engine thread hands replies to a sender thread (:mod:`.reply_pump`),
  which merges a stream's steps while it is behind.
- Cancellation: a client that calls this model directly is seen through
  ``request.is_cancelled()``, or sends TensorRT-LLM's stop request (``stop`` = true
  with the request id of its stream); a client that cancels an ensemble through
  postprocess, which sends back the reply's ``cancel_token`` (:mod:`.cancel_channel`),
  or through the ``cancel`` model. Either way the engine aborts the sequence and the
  stream ends (:mod:`.in_flight`).
- ``finalize`` ends every open stream and shuts the engine down.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback

import triton_python_backend_utils as pb_utils

from .inputs import input_getter
from .cancel_channel import CANCEL_TOKEN, CancelListener
from .generate_request import RequestError, parse_token_request, scalar
from .in_flight import InFlight
from .metrics import EngineMetrics, Poller
from .perf_outputs import PERF_OUTPUT_NAMES
from .postprocess import PROMPT_ECHO
from .reply_pump import ReplyPump
from .lora_requests import resolve_adapter
from .response_arrays import ENGINE_OUTPUT_NAMES, PROMPT_OUTPUT_NAMES, TOP_OUTPUT_NAMES, string_array
from .response_stream import Reply, ResponseStream
from .settings import EngineSettings, model_limits
from .stub_exit import exit_stub

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
STOP = "stop"     # BOOL [1, 1]: TensorRT-LLM's stop request


def _log(level: str, message: str) -> None:
    logger = pb_utils.Logger
    getattr(logger, f"log_{level}")(f"[tandem] {message}")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import torch

        model_config = json.loads(args["model_config"])
        name, version = args.get("model_name", "llm"), str(args.get("model_version", "1"))
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                f"model {name!r} streams tokens and must be decoupled: "
                "set model_transaction_policy { decoupled: true } in config.pbtxt")
        self.settings = EngineSettings.from_model_config(model_config)
        torch.set_num_threads(self.settings.threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set in this process
            pass

        s = self.settings
        self.vocab_size, self.max_model_len = model_limits(s.model_dir)
        self.model_version = version     # a key of the engine's prefix cache
        self.adapters = s.adapters()    # the server's LoRA adapter registry (None: no LoRA)
        self.engine = self._make_engine(s)
        self.engine.on_fatal = self._engine_failed
        if self.engine.tokenizer is None:
            raise pb_utils.TritonModelException(
                f"model_dir {s.model_dir} has no tokenizer.json; model {name!r} detokenizes its output")
        self.engine.start()
        self.in_flight = InFlight(self.engine, s.cancel_poll_ms / 1000.0)
        # responses leave on a thread of their own, not the engine's (reply_pump)
        self.replies = ReplyPump()
        # keyed by instance, version and process: a new version, or the same one
        # reloaded, loads while the old one drains
        instance = args.get("model_instance_name", f"{name}_0")
        self.cancel_listener = CancelListener(f"{instance}.{version}.{os.getpid()}",
                                              lambda key: self.in_flight.cancel(key, notify=False))
        self.metrics = EngineMetrics(name, version, dtype=s.dtype)
        self.metrics_poller = Poller(self._poll_metrics)
        _log("info", f"engine ready: {s.model_dir} dtype={s.dtype} page_size={s.page_size} "
                     f"kv_layout={s.kv_layout} torch_threads={s.threads}")

    def _make_engine(self, s: EngineSettings):
        """The engine this model streams from (the decode model puts it on the shared pool)."""
        from tandem.backends.engine.async_engine import AsyncEngine

        return AsyncEngine(s.model_dir, **s.engine_kwargs(), model_version=self.model_version)

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine thread stopped (its open streams already ended UNAVAILABLE)."""
        exit_stub("tandem", exc)

    def _poll_metrics(self) -> None:
        """Engine counters and KV pages (the decode model adds the shared pool)."""
        self.metrics.poll_engine(self.engine)

    def _submit(self, request, parsed, index: int, on_output, adapter=None) -> str:
        """Hand sample ``index`` of a parsed request (under LoRA ``adapter``, or the base
        model) to the engine; returns its engine request id (the decode model submits
        sample 0 on the transferred KV)."""
        params = parsed.sampling_params(index, self.engine.tokenizer)
        return self.engine.submit(parsed.prompt, params, on_output, lora=adapter)

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None  # decoupled: responses go through each request's sender

    def _start(self, request) -> None:
        sender = request.get_response_sender()

        get = input_getter(request)

        try:
            if scalar(get, STOP):
                self._stop(request, sender)
                return
            parsed = parse_token_request(get, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            echo = scalar(get, PROMPT_ECHO)
            adapter = resolve_adapter(parsed, self.adapters)
        except RequestError as exc:
            _send_error(sender, str(exc))
            self.metrics.finish("rejected")
            return

        key, token = self.cancel_listener.new_token()
        # for the ensemble's postprocess step, on every reply
        relay = {CANCEL_TOKEN: string_array(token),
                 PROMPT_ECHO: string_array(b"" if echo is None else bytes(echo))}
        names = reply_names(parsed, echo)
        stream = ResponseStream(parsed, self.replies.outbox(lambda reply: _send(sender, reply, names)).put, relay)
        in_flight, metrics = self.in_flight, self.metrics

        def on_output(out, index: int, clock) -> None:  # engine thread
            try:
                metrics.output(clock, out)
                stream.on_output(out, index)
            except Exception as exc:
                _log("error", f"response failed: {traceback.format_exc()}")
                if stream.fail(f"internal error: {exc}", code="INTERNAL"):
                    self.engine.abort(out.request_id)
            if stream.closed:
                in_flight.ended(key)

        # before submit: the first reply already carries the token. Only the text ensembles
        # send prompt_echo; their postprocess carries the client's cancel (in_flight)
        in_flight.add(key, request, stream, poll=echo is None, request_id=request.request_id() or "")
        try:
            for index in range(parsed.num_return_sequences):
                if index and stream.closed:     # a sibling failed, or the client cancelled
                    break                       # (sample 0 goes in even so: decode's KV ticket)
                # before submit: the engine may finish the request before it returns
                clock = metrics.submitted()
                try:
                    rid = self._submit(request, parsed, index,
                                       lambda out, i=index, c=clock: on_output(out, i, c), adapter)
                except Exception as exc:
                    metrics.not_submitted()
                    self._refused(stream, exc)
                    in_flight.ended(key)
                    break
                in_flight.started(key, rid, index)
        finally:
            in_flight.submitted(key)

    def _stop(self, request, sender) -> None:
        """TensorRT-LLM's stop request: the stream sent with this request's id ends (its
        final flag), and this request gets an empty final response."""
        rid = request.request_id() or ""
        if not rid:
            _send_error(sender, f"{STOP}: a stop request needs the request id of the stream to stop")
        elif not self.in_flight.stop(rid):
            _send_error(sender, f"{STOP}: no stream with request id {rid!r} is in flight here")
        else:
            sender.send(flags=FINAL)

    def _refused(self, stream: ResponseStream, exc: Exception) -> None:
        from tandem.backends.engine.async_engine import EngineStopped

        if isinstance(exc, (ValueError, RequestError)):  # the engine's own validation (KV pool too small, ...)
            if stream.fail(str(exc)):
                self.metrics.finish("rejected")
        elif isinstance(exc, EngineStopped):
            if stream.fail(f"unavailable: {exc}", code="UNAVAILABLE"):
                self.metrics.finish("error")
        else:
            _log("error", f"submit failed: {traceback.format_exc()}")
            if stream.fail(f"internal error: {exc}", code="INTERNAL"):
                self.metrics.finish("error")

    def finalize(self) -> None:
        start = time.monotonic()
        listener = getattr(self, "cancel_listener", None)
        if listener is not None:
            listener.close()
        in_flight = getattr(self, "in_flight", None)
        if in_flight is not None:
            in_flight.close("the server is shutting down; request aborted")
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        replies = getattr(self, "replies", None)
        if replies is not None:
            replies.close()   # the streams' last replies go out before the stub ends
        poller = getattr(self, "metrics_poller", None)
        if poller is not None:
            poller.stop()
        # metric objects must die while the stub can still talk to the server: left to
        # interpreter teardown they are destroyed after its IPC is gone and crash the stub
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self.metrics = None
        gc.collect()
        _log("info", f"finalized in {time.monotonic() - start:.2f} s")


def _send_error(sender, message: str) -> None:
    _send(sender, Reply(error=message, final=True))


def _error_code(code: str):
    return getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)


REPLY_NAMES = (*ENGINE_OUTPUT_NAMES, CANCEL_TOKEN, PROMPT_ECHO)


def reply_names(parsed, echo) -> tuple[str, ...]:
    """The outputs each reply of a stream carries. A client of this model gets every
    declared one. A text ensemble's step (preprocess sent ``prompt_echo``) feeds only
    postprocess, which reads absent log probs, sequence index, echo and perf metrics as
    none, 0, "" and zeros: those are left out when they would say just that (every
    tensor is copied four times between here and the ensemble's response)."""
    if echo is None:
        return REPLY_NAMES
    skip = set()
    if not bytes(echo):
        skip.add(PROMPT_ECHO)
    if not parsed.return_log_probs:
        skip |= {"cum_log_probs", "output_log_probs"}
    if not parsed.num_top_log_probs:
        skip |= set(TOP_OUTPUT_NAMES)
    if parsed.num_prompt_log_probs is None:
        skip |= set(PROMPT_OUTPUT_NAMES)
    if parsed.num_return_sequences == 1:
        skip.add("sequence_index")
    if not parsed.return_perf_metrics:
        skip |= set(PERF_OUTPUT_NAMES) - {"num_cached_tokens"}
    return tuple(n for n in REPLY_NAMES if n not in skip)


def _send(sender, reply: Reply, names: tuple[str, ...] = REPLY_NAMES) -> None:
    outputs = reply.outputs
    if reply.error is not None:
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(reply.error, _error_code(reply.code)))
    elif outputs is not None:
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, outputs[name]) for name in names if name in outputs])
    else:
        response = None
    try:
        if response is None:
            sender.send(flags=FINAL)
        else:
            sender.send(response, flags=FINAL if reply.final else 0)
    except Exception as exc:  # the client went away; the watcher sees the cancellation
        _log("verbose", f"response not delivered: {exc}")

