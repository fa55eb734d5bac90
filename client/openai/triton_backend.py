"""The text ensemble over tritonclient's asyncio gRPC stream (``tritonclient.grpc.aio``).

One OpenAI choice is one gRPC ``ModelStreamInfer`` stream carrying one request: the
request goes out, the stream is half-closed, and the ensemble's responses come back
until the one with Triton's final flag (``enable_empty_final_response``). Leaving the
iterator early (the HTTP client went away, the task was cancelled) cancels the gRPC
call, which makes Triton cancel the request; in a full ensemble ``postprocess`` carries
that to the engine, which frees the sequence's KV pages. A direct ensemble
(``tandem_direct``: no postprocess) has no such carrier, so the stream's
``cancel_token`` goes to the ``cancel`` model (:meth:`TritonBackend.generate` with
``cancel_model``); a stream given up before its first response is read on in the
background until the token arrives. A request that already ended is not cancelled
(tritonserver 2.51 may fail to unload a model after a completed request was cancelled).

>>> backend = TritonBackend("127.0.0.1:8001")                                # doctest: +SKIP
>>> async for r in backend.generate("tandem", {"text_input": ...}):          # doctest: +SKIP
...     print(r.text, r.finish_reason)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from .protocol import OpenAIError

TRITON_TYPES = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64",
                np.dtype(np.bool_): "BOOL", np.dtype(np.object_): "BYTES"}
FINAL = "triton_final_response"
CANCEL_TOKEN = "cancel_token"
CANCEL_MODEL = "cancel"
# how long a stream given up before its first response is read on for its cancel token
CANCEL_TOKEN_WAIT_S = 60.0


@dataclass(slots=True)
class EnsembleResponse:
    """One response of the ensemble (the fields of ``backends/triton/generate_request.py``)."""

    text: str = ""
    finish_reason: str = ""       # "" until the last response with data
    num_input_tokens: int = 0
    num_output_tokens: int = 0    # cumulative
    num_cached_tokens: int | None = None   # None: the ensemble did not say
    final: bool = False
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    # with num_top_log_probs: each token's most likely alternatives (ids, log probabilities)
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)
    # with num_prompt_log_probs, on the first response: the prompt's tokens, their log
    # probabilities (None at 0) and the alternatives at each position (empty at 0)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_log_probs: list[float | None] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_log_probs: list[list[float]] = field(default_factory=list)
    cancel_token: bytes | None = None     # a direct ensemble's: what the cancel model takes


@dataclass(slots=True, frozen=True)
class ModelInterface:
    inputs: frozenset[str]
    outputs: frozenset[str]


def _first(result, name: str):
    arr = result.as_numpy(name)
    return None if arr is None or arr.size == 0 else arr.reshape(-1)[0]


def _text(value) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value or "")


def parse_result(result) -> EnsembleResponse:
    """A tritonclient result as an :class:`EnsembleResponse` (any batch shape: ``[1]``
    or ``[1, 1]`` per row)."""
    response = result.get_response()
    final = FINAL in response.parameters and bool(response.parameters[FINAL].bool_param)
    if not response.outputs:
        return EnsembleResponse(final=final)
    raw = response.raw_output_contents
    if len(raw) == len(response.outputs):
        return _parse_raw(response.outputs, raw, final)
    ids = result.as_numpy("output_ids")
    lps = result.as_numpy("output_log_probs")
    r = EnsembleResponse(
        text=_text(_first(result, "text_output")), finish_reason=_text(_first(result, "finish_reason")),
        num_input_tokens=int(_first(result, "num_input_tokens") or 0),
        num_output_tokens=int(_first(result, "num_output_tokens") or 0), final=final,
        num_cached_tokens=None if _first(result, "num_cached_tokens") is None
        else int(_first(result, "num_cached_tokens")),
        output_ids=[] if ids is None else [int(t) for t in ids.reshape(-1)],
        log_probs=[] if lps is None else [float(x) for x in lps.reshape(-1)],
        cancel_token=None if _first(result, CANCEL_TOKEN) is None else bytes(_first(result, CANCEL_TOKEN)))
    for name in RANKED_OUTPUTS:
        arr = result.as_numpy(name)
        if arr is not None:
            _set_ranked(r, name, arr)
    return r


# the log-probability outputs beyond the sampled tokens' (backends/triton/response_arrays.py)
RANKED_OUTPUTS = ("output_top_token_ids", "output_top_log_probs", "prompt_token_ids", "prompt_log_probs",
                  "prompt_top_token_ids", "prompt_top_log_probs")


def _set_ranked(r: EnsembleResponse, name: str, arr: np.ndarray) -> None:
    """One of :data:`RANKED_OUTPUTS` into ``r``: rows of alternatives ([1, rows, k]), or
    the prompt's ids and log probabilities ([1, P]); NaN (nothing predicts the prompt's
    first token) reads as None, and position 0's padding of alternatives is dropped."""
    if name in ("prompt_token_ids", "prompt_log_probs"):
        values = arr.reshape(-1).tolist()
        if name == "prompt_token_ids":
            r.prompt_ids = [int(v) for v in values]
        else:
            r.prompt_log_probs = [None if v != v else float(v) for v in values]
        return
    rows = arr.reshape(-1, arr.shape[-1]).tolist() if arr.size else []
    if name.startswith("prompt") and rows:
        rows[0] = []
    setattr(r, {"output_top_token_ids": "top_ids", "output_top_log_probs": "top_log_probs",
                "prompt_top_token_ids": "prompt_top_ids", "prompt_top_log_probs": "prompt_top_log_probs"}[name],
            [[int(v) for v in row] for row in rows] if name.endswith("ids") else rows)


def _parse_raw(outputs, raw, final: bool) -> EnsembleResponse:
    """:func:`parse_result` straight from the response's raw tensors: once per streamed
    chunk, and tritonclient's ``as_numpy`` (a search by name and an array per output)
    cost ~150 µs a chunk here, this a tenth of it. Every value read is a tensor's first
    element (a BYTES element is a 4-byte little-endian length, then the bytes)."""
    r = EnsembleResponse(final=final)
    for out, data in zip(outputs, raw):
        name = out.name
        if name in ("text_output", "finish_reason"):
            text = _first_bytes(data).decode("utf-8", errors="replace")
            if name == "text_output":
                r.text = text
            else:
                r.finish_reason = text
        elif name in ("num_input_tokens", "num_output_tokens"):
            value = int.from_bytes(data[:4], "little") if len(data) >= 4 else 0
            if name == "num_input_tokens":
                r.num_input_tokens = value
            else:
                r.num_output_tokens = value
        elif name == "num_cached_tokens":
            r.num_cached_tokens = int.from_bytes(data[:4], "little") if len(data) >= 4 else 0
        elif name == "output_ids":
            r.output_ids = np.frombuffer(data, dtype="<i4").tolist()
        elif name == "output_log_probs":
            r.log_probs = np.frombuffer(data, dtype="<f4").astype(float).tolist()
        elif name == CANCEL_TOKEN:
            r.cancel_token = _first_bytes(data) or None
        elif name in RANKED_OUTPUTS:
            dtype = "<i4" if name.endswith("ids") else "<f4"
            _set_ranked(r, name, np.frombuffer(data, dtype=dtype).reshape(list(out.shape)))
    return r


def _first_bytes(data: bytes) -> bytes:
    if len(data) < 4:
        return b""
    n = int.from_bytes(data[:4], "little")
    return data[4:4 + n]


class TritonBackend:
    """Streams to the ensembles of one tritonserver over one gRPC channel.

    Create and use it inside one event loop (a ``grpc.aio`` channel belongs to the loop
    that made it); :meth:`close` it in the same loop.
    """

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url
        self.timeout_s = timeout_s
        self._client = None
        self._interfaces: dict[str, ModelInterface] = {}
        self._background: set = set()     # cancels in flight (a reference keeps each task alive)
        self._routes: dict[str, tuple[str, str | None]] = {}

    @property
    def client(self):
        if self._client is None:
            import tritonclient.grpc.aio as aioclient
            self._client = aioclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        import asyncio
        if self._background:   # cancels still on their way: the engine frees those pages
            await asyncio.wait(set(self._background), timeout=5)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def direct_route(self, model: str) -> tuple[str, str | None]:
        """``(ensemble, cancel model)`` to stream ``model``'s requests through: its direct
        twin (no postprocess step: one hop less per token) and the ``cancel`` model when the
        server serves both, else ``model`` itself and None (asked once per model)."""
        from tandem.client.serve.options import DIRECT
        if model not in self._routes:
            twin, route = DIRECT.get(model), (model, None)
            if twin is not None and await self._serves(twin) and await self._serves(CANCEL_MODEL):
                route = (twin, CANCEL_MODEL)
            self._routes[model] = route
        return self._routes[model]

    async def tokens_route(self, model: str) -> str | None:
        """The ensemble that takes ``model``'s prompts as token ids (``input_ids``), when the
        server serves one (the disaggregated path's ``tandem_tokens``), else None."""
        from tandem.client.serve.options import TOKENS
        twin = TOKENS.get(model)
        return twin if twin is not None and await self._serves(twin) else None

    async def _serves(self, model: str) -> bool:
        try:
            return bool(await self.client.is_model_ready(model))
        except Exception:
            return False

    def declares_output(self, model: str, name: str) -> bool:
        """Whether ``model``'s interface, as last asked, has output ``name``."""
        iface = self._interfaces.get(model)
        return iface is not None and name in iface.outputs

    async def interface(self, model: str) -> ModelInterface:
        """The inputs and outputs ``model`` declares (asked once; asked again after an error)."""
        if model not in self._interfaces:
            try:
                config = (await self.client.get_model_config(model, as_json=True))["config"]
            except Exception as exc:
                raise unreachable(self.url, exc) from None
            self._interfaces[model] = ModelInterface(frozenset(i["name"] for i in config.get("input", [])),
                                                     frozenset(o["name"] for o in config.get("output", [])))
        return self._interfaces[model]

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except Exception:
            return False

    async def generate(self, model: str, arrays: dict[str, np.ndarray], request_id: str = "",
                       outputs: tuple[str, ...] | None = None,
                       cancel_model: str | None = None) -> AsyncIterator[EnsembleResponse]:
        """Yield the ensemble's responses to one request, the final one last.

        ``outputs``: the outputs to ask for (None: all it declares); fewer are less work
        for the server and here. ``cancel_model``: ``model`` is a direct ensemble, whose
        stream, when left early, is cancelled through that model with its
        ``cancel_token`` (asked for with the outputs). Raises :class:`OpenAIError`: the ensemble's error (its status read off the
        message, :func:`~.ensemble_request.upstream_error`), or 503 when the server
        cannot be reached or the stream broke.
        """
        from tritonclient.utils import InferenceServerException

        from .ensemble_request import upstream_error

        inputs = [_infer_input(name, arr) for name, arr in arrays.items()]
        if cancel_model is not None and outputs is not None and CANCEL_TOKEN not in outputs:
            outputs = (*outputs, CANCEL_TOKEN)
        requested = None if outputs is None else [_requested_output(name) for name in outputs]
        token = None

        async def requests():
            yield {"model_name": model, "inputs": inputs, "request_id": request_id, "outputs": requested,
                   "parameters": {"triton_enable_empty_final_response": True}}

        call = self.client.stream_infer(requests(), stream_timeout=self.timeout_s)
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    self._interfaces.pop(model, None)   # a reloaded model may declare other inputs
                    raise upstream_error(error.message() if hasattr(error, "message") else str(error))
                response = parse_result(result)
                finished = response.final
                token = token or response.cancel_token
                yield response
                if finished:
                    return
            finished = True
            raise OpenAIError(503, f"the stream to {self.url} ended before the final response; retry",
                              code="unavailable")
        except (InferenceServerException, _grpc_error()) as exc:
            finished = True
            raise unreachable(self.url, exc) from None
        finally:
            if not finished:
                if cancel_model is None:
                    call.cancel()
                else:
                    self._spawn(self._cancel_direct(call, cancel_model, token))

    def _spawn(self, coro) -> None:
        import asyncio
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_direct(self, call, cancel_model: str, token: bytes | None) -> None:
        """Cancel a direct ensemble's stream: its token to ``cancel_model`` (read on until
        the first response brings it, at most :data:`CANCEL_TOKEN_WAIT_S`), then the call."""
        import asyncio

        import tritonclient.grpc as grpcclient
        try:
            if token is None:
                async def first_token():
                    async for result, error in call:
                        if error is not None:
                            return None
                        r = parse_result(result)
                        if r.cancel_token or r.final:
                            return r.cancel_token
                    return None
                token = await asyncio.wait_for(first_token(), CANCEL_TOKEN_WAIT_S)
            if token is not None:
                t = grpcclient.InferInput(CANCEL_TOKEN, [1], "BYTES")
                t.set_data_from_numpy(np.array([token], dtype=np.object_))
                await self.client.infer(cancel_model, [t], client_timeout=10)
        except Exception:   # the server went away, or the stream ended meanwhile: nothing to free
            pass
        finally:
            call.cancel()


def unreachable(url: str, exc: BaseException) -> OpenAIError:
    detail = exc.details() if hasattr(exc, "details") else (exc.message() if hasattr(exc, "message") else exc)
    return OpenAIError(503, f"the Triton server at {url} is unavailable ({detail}); retry", code="unavailable")


def _grpc_error():
    import grpc
    return grpc.RpcError


def _infer_input(name: str, arr: np.ndarray):
    import tritonclient.grpc as grpcclient
    t = grpcclient.InferInput(name, list(arr.shape), TRITON_TYPES[arr.dtype])
    t.set_data_from_numpy(arr)
    return t



def _requested_output(name: str):
    import tritonclient.grpc as grpcclient
    return grpcclient.InferRequestedOutput(name)
