"""The routes of the OpenAI-compatible API (FastAPI), in front of Tandem's text ensembles.

=============================  ====================================================
``GET  /v1/models``            the served ensembles (``/v1/models/{id}``: one)
``POST /v1/completions``       text completion; ``stream``: SSE ending ``data: [DONE]``
``POST /v1/chat/completions``  chat, through the checkpoint's chat template
``GET  /health``               200 when tritonserver answers ready, else 503
``GET  /metrics``              the frontend's Prometheus metrics (:mod:`.metrics`)
=============================  ====================================================

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
bad field (this API's checks and the ensemble's ``INVALID_ARG``), 404 for an unknown model
or path, 503 when the server or a step is unavailable (a full KV pool, a model
reloading), 500 otherwise. A streamed request the ensemble refuses is refused with the
HTTP status before the stream starts; an error after that is one
``data: {"error": ...}`` event, then ``data: [DONE]``.

>>> app = create_app("127.0.0.1:8001", ["tandem"], model_dir="checkpoints/demo/target")  # doctest: +SKIP
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .auth import ApiKeyMiddleware
from .chat_template import ChatTemplate, ChatTemplateError
from .ensemble_request import CACHED_OUTPUT, LOG_PROBS_OUTPUT, PROMPT_INPUT, TOP_INPUT, ensemble_inputs
from .metrics import FrontendMetrics, MetricsMiddleware
from .protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRARequest, ModelCard, ModelList, OpenAIError,
                       UnloadLoRARequest, Usage,
                       invalid, new_id, now)
from .responses import (SSE_DONE, Choice, Event, chat_logprobs, completion_logprobs, error_event, first_events,
                        merged, sse)
from .lora import LoRAServing
from .tool_parsers import tool_parser
from .tools import guide_errors_on_tools, template_messages
from .triton_backend import RANKED_OUTPUTS, TritonBackend

COMPLETIONS_DEFAULT_MAX_TOKENS = 16    # OpenAI's; chat defaults to the rest of the context
MAX_CHOICES = 64                       # prompts x n in one completions request
CLIENT_GONE = 499
BASE_OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")


@dataclass(slots=True)
class Checkpoint:
    """What the frontend reads from the checkpoint: the chat template, the tokenizer (a
    chat request's default ``max_tokens`` is the rest of the context; the tokens of log
    probabilities), and the context length."""

    chat_template: ChatTemplate
    tokenizer: object | None = None
    max_model_len: int | None = None

    @classmethod
    def load(cls, model_dir: str | Path | None) -> "Checkpoint":
        template = ChatTemplate.for_checkpoint(model_dir)
        if model_dir is None:
            return cls(template)
        model_dir = Path(model_dir)
        tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
        return cls(template, tokenizer, config.get("max_position_embeddings"))

    def prompt_tokens(self, text: str) -> int | None:
        return None if self.tokenizer is None else len(self.tokenizer.encode(text).ids)


class Frontend:
    """The app's state: the gRPC backend (made in the server's event loop), the served
    models, the checkpoint and the metrics."""

    def __init__(self, triton_url: str, models: list[str], model_dir: str | Path | None,
                 request_timeout_s: float):
        self.triton_url, self.models = triton_url, list(models)
        self.checkpoint = Checkpoint.load(model_dir)
        self.metrics = FrontendMetrics()
        self.request_timeout_s = request_timeout_s
        self.backend: TritonBackend | None = None
        self.tool_call_parser: str | None = None      # reads tool_choice "auto" answers
        self.lora: LoRAServing | None = None          # the adapters, on a server that serves them

    def model(self, name: str) -> str:
        """The ensemble serving ``name``: a model, or the base of a LoRA adapter."""
        if name in self.models:
            return name
        if self.adapter_of(name) is not None:
            return self.models[0]
        served = self.models + (self.lora.registry.names() if self.lora is not None else [])
        raise OpenAIError(404, f"The model {name!r} does not exist; this server serves: "
                               f"{', '.join(served)}", param="model", code="model_not_found")

    def adapter_of(self, name: str) -> str | None:
        """``name`` if it names a LoRA adapter this server serves."""
        if self.lora is None or name in self.models:
            return None
        return name if self.lora.adapter(name) is not None else None

    def cards(self) -> list[ModelCard]:
        cards = [ModelCard(id=m) for m in self.models]
        if self.lora is not None:
            cards += [ModelCard(id=e.name, parent=self.models[0], root=e.path) for e in self.lora.registry.entries()]
        return cards


def create_app(triton_url: str, models: list[str], model_dir: str | Path | None = None,
               request_timeout_s: float = 600.0, api_key: str | None = None,
               tool_call_parser: str | None = None, lora: LoRAServing | None = None) -> FastAPI:
    """The ASGI app serving ``models`` (text ensembles of the tritonserver at gRPC
    ``triton_url``); ``model_dir`` is the checkpoint (its chat template and tokenizer);
    with ``api_key``, ``/v1/*`` requires ``Authorization: Bearer <api_key>`` (:mod:`.auth`);
    ``tool_call_parser`` reads ``tool_choice: "auto"`` answers (:mod:`.tool_parsers`)."""
    fe = Frontend(triton_url, models, model_dir, request_timeout_s)
    tool_parser(tool_call_parser)      # an unknown name: ValueError before anything serves
    fe.tool_call_parser = tool_call_parser
    fe.lora = lora

    @asynccontextmanager
    async def lifespan(_app):
        fe.backend = TritonBackend(triton_url, timeout_s=request_timeout_s)
        try:
            yield
        finally:
            await fe.backend.close()

    app = FastAPI(title="Tandem OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.frontend = fe
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=fe.metrics)   # outermost: counts the 401s too
    _error_handlers(app)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=fe.cards())

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        fe.model(model)      # a 404 for a name nothing serves
        return next(c for c in fe.cards() if c.id == model)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> Response:
        entry = _lora(fe).load(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{entry.name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> Response:
        entry = _lora(fe).unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{entry.name}' removed successfully.", media_type="text/plain")

    @app.get("/health")
    async def health() -> Response:
        ok = await fe.backend.ready()
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(fe.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _completions(fe, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _chat(fe, body, request)

    return app


def _lora(fe: Frontend) -> LoRAServing:
    if fe.lora is None:
        raise invalid("lora_name", "this server serves no LoRA adapters; start it with --max-loras N "
                                   "(and --lora-modules name=DIR,...)")
    return fe.lora


# ---- completions ----------------------------------------------------------------------------------
async def _completions(fe: Frontend, body: CompletionRequest, request: Request):
    t0 = time.perf_counter()
    model = fe.model(body.model)
    body.unsupported()
    prompts = body.prompts()
    if len(prompts) * body.n > MAX_CHOICES:
        raise invalid("n", f"{len(prompts)} prompts x n={body.n} choices; allowed: at most {MAX_CHOICES}")
    logprobs = body.logprobs is not None
    if body.echo and logprobs and not isinstance(prompts[0], str) and fe.checkpoint.tokenizer is None:
        raise invalid("echo", "echo of a token-id prompt needs the checkpoint's tokenizer, which this API "
                              "was started without")
    target = model if isinstance(prompts[0], str) else await _tokens_route(fe, model)
    arrays = await _inputs(fe, target, body, [(p, j) for p in prompts for j in range(body.n)],
                           body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs)
    rid, created = new_id("cmpl"), now()
    events = await _start(fe, target, arrays, rid)
    echo = [_prompt_text(fe, prompts[i // body.n]) if body.echo else "" for i in range(len(arrays))]
    vllm_prompt = body.prompt_logprobs is not None

    def chunk(choices: list[dict], usage: Usage | None = None) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": choices, **({"usage": usage.model_dump()} if usage else {})})

    if body.stream:
        first = await _first_or_close(events, len(arrays))

        async def stream() -> AsyncIterator[str]:
            choices = [Choice(i) for i in range(len(arrays))]
            started = [False] * len(choices)
            async for ev in _replay(first, events):
                if ev.error is not None:
                    yield _stream_error(fe, "/v1/completions", ev.error)
                    break
                c = choices[ev.index]
                n_tokens = len(c.tokens)
                text = c.add(ev.response, fe.checkpoint.tokenizer)
                if not (text or ev.response.finish_reason or len(c.tokens) > n_tokens):
                    continue
                if text:
                    _first_token(fe, "/v1/completions", t0, choices)
                opening, started[c.index] = not started[c.index], True
                lp = None
                if logprobs:
                    lp = completion_logprobs(c, n_tokens, len(c.text) - len(text),
                                             with_prompt=opening and body.echo)
                prefix, echo[c.index] = echo[c.index], ""
                yield chunk([{"index": c.index, "text": prefix + text, "logprobs": lp,
                              "finish_reason": ev.response.finish_reason or None,
                              **_prompt_logprobs(c, vllm_prompt and opening)}])
            else:
                _count_tokens(fe, "/v1/completions", choices, body.n)
                if body.include_usage():
                    yield chunk([], _usage(choices, body.n))
            yield SSE_DONE
        return _sse_response(stream())

    choices = await _collect(fe, events, len(arrays), request)
    _count_tokens(fe, "/v1/completions", choices, body.n)
    return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
            "choices": [{"index": c.index, "text": echo[c.index] + c.text,
                         "logprobs": completion_logprobs(c, 0, len(echo[c.index]), with_prompt=body.echo)
                         if logprobs else None,
                         "finish_reason": c.finish_reason or "stop", **_prompt_logprobs(c, vllm_prompt)}
                        for c in choices],
            "usage": _usage(choices, body.n).model_dump()}


def _prompt_logprobs(c: Choice, asked: bool) -> dict:
    """vLLM's ``prompt_logprobs`` field of a choice, when asked for."""
    return {"prompt_logprobs": c.prompt.vllm() if c.prompt is not None else None} if asked else {}


# ---- chat ----------------------------------------------------------------------------------------
async def _chat(fe: Frontend, body: ChatCompletionRequest, request: Request):
    t0 = time.perf_counter()
    model = fe.model(body.model)
    body.unsupported()
    tools = body.tool_plan()
    tools.check_parser(fe.tool_call_parser)
    try:
        prompt = fe.checkpoint.chat_template.render(template_messages(body.messages), tools=tools.template_tools)
    except ChatTemplateError as exc:
        raise invalid("messages", str(exc)) from None
    max_tokens = body.token_limit() or _rest_of_context(fe, prompt)
    arrays = await _inputs(fe, model, body, [(prompt, j) for j in range(body.n)], max_tokens, body.logprobs)
    rid, created = new_id("chatcmpl"), now()
    events = await _start(fe, model, arrays, rid)
    if tools.guided:
        events = guide_errors_on_tools(events)
    top = body.top_logprobs or 0

    def chunk(choices: list[dict], usage: Usage | None = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": choices, **({"usage": usage.model_dump()} if usage else {})})

    if body.stream:
        first = await _first_or_close(events, len(arrays))

        async def stream() -> AsyncIterator[str]:
            choices = [Choice(i) for i in range(len(arrays))]
            readers = [tools.stream(fe.tool_call_parser) for _ in choices]   # text -> content / tool_calls
            logged = [0] * len(choices)          # tokens whose log probabilities went out
            for c in choices:   # the role comes first, as OpenAI sends it
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for ev in _replay(first, events):
                if ev.error is not None:
                    yield _stream_error(fe, "/v1/chat/completions", ev.error)
                    break
                c = choices[ev.index]
                text = c.add(ev.response, fe.checkpoint.tokenizer)
                reason = ev.response.finish_reason or None
                if text:
                    _first_token(fe, "/v1/chat/completions", t0, choices)
                reader = readers[c.index]
                for delta in (reader.feed(text) if text else []) + (reader.finish() if reason else []):
                    yield chunk([{"index": c.index, "delta": delta,
                                  "logprobs": chat_logprobs(c, logged[c.index], top) if body.logprobs else None,
                                  "finish_reason": None}])
                    logged[c.index] = len(c.tokens)
                if reason:
                    yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                  "finish_reason": reader.finish_reason(reason)}])
            else:
                _count_tokens(fe, "/v1/chat/completions", choices, body.n)
                if body.include_usage():
                    yield chunk([], _usage(choices, body.n))
            yield SSE_DONE
        return _sse_response(stream())

    choices = await _collect(fe, events, len(arrays), request)
    _count_tokens(fe, "/v1/chat/completions", choices, body.n)
    answers = [tools.answer(c.text, c.finish_reason or "stop", fe.tool_call_parser) for c in choices]
    return {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
            "choices": [{"index": c.index, "message": message,
                         "logprobs": chat_logprobs(c, 0, top) if body.logprobs else None,
                         "finish_reason": reason, **_prompt_logprobs(c, body.prompt_logprobs is not None)}
                        for c, (message, reason) in zip(choices, answers)],
            "usage": _usage(choices, body.n).model_dump()}


# ---- shared steps ------------------------------------------------------------------------------
async def _inputs(fe: Frontend, model: str, body, prompts: list[tuple[str, int]], max_tokens: int,
                  logprobs: bool) -> list[dict]:
    """The tensors of each choice (prompt, index among the prompt's n). Always streamed
    from the ensemble, a whole response too: a stream is what can be cancelled when the
    client goes away (by its ``cancel_token``, or through the full ensemble's
    ``postprocess``), a request answered once at its end could not be."""
    iface = await fe.backend.interface(model)
    if logprobs and LOG_PROBS_OUTPUT not in iface.outputs:
        raise invalid("logprobs", f"not supported by this server: ensemble {model!r} has no output "
                                  f"{LOG_PROBS_OUTPUT!r}")
    lora_name = fe.adapter_of(body.model)
    return [ensemble_inputs(body, p, iface.inputs, index=j, max_tokens=max_tokens, stream=True,
                            logprobs=logprobs, model=model, lora_name=lora_name) for p, j in prompts]


async def _start(fe: Frontend, model: str, arrays: list[dict], rid: str) -> AsyncIterator[Event]:
    """The choices' streams, merged: from the model's direct twin where the server has one
    (its replies straight from the engine model), from the full ensemble for log
    probabilities (which only it returns)."""
    logprobs = "return_log_probs" in arrays[0] or PROMPT_INPUT in arrays[0]
    target, cancel = (model, None) if logprobs else await fe.backend.direct_route(model)
    # only the outputs read here (Tandem's ensembles send every declared output on every
    # response, so asking for fewer never holds a response back)
    wanted = BASE_OUTPUTS + (("output_log_probs",) if "return_log_probs" in arrays[0] else ()) + (
        RANKED_OUTPUTS[:2] if TOP_INPUT in arrays[0] else ()) + (
        RANKED_OUTPUTS[2:] if PROMPT_INPUT in arrays[0] else ()) + (
        (CACHED_OUTPUT,) if fe.backend.declares_output(model, CACHED_OUTPUT) else ())
    return merged([fe.backend.generate(target, a, request_id=f"{rid}-{i}", outputs=wanted, cancel_model=cancel)
                   for i, a in enumerate(arrays)])


async def _tokens_route(fe: Frontend, model: str) -> str:
    """The ensemble that takes ``model``'s token-id prompts; 400 where the server has none."""
    twin = await fe.backend.tokens_route(model)
    if twin is None:
        raise invalid("prompt", f"token-id prompts need the token-ids twin of {model!r} (tandem_tokens, on the "
                                "disaggregated path), which this server does not serve; send text")
    return twin


def _prompt_text(fe: Frontend, prompt: str | list[int]) -> str:
    """What ``echo`` puts before the completion: the prompt, a token-id one decoded."""
    if isinstance(prompt, str):
        return prompt
    if fe.checkpoint.tokenizer is None:
        raise invalid("echo", "echo of a token-id prompt needs the checkpoint's tokenizer, which this API "
                              "was started without")
    return fe.checkpoint.tokenizer.decode(prompt, skip_special_tokens=False)


def _rest_of_context(fe: Frontend, prompt: str) -> int:
    """A chat request without ``max_tokens`` may fill the context (as OpenAI's and vLLM's);
    a prompt that leaves no room gets 1, and the ensemble refuses it by its length."""
    n, limit = fe.checkpoint.prompt_tokens(prompt), fe.checkpoint.max_model_len
    if n is None or limit is None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return max(1, limit - n)


async def _first_or_close(events: AsyncIterator[Event], n: int) -> list[Event]:
    try:
        return await first_events(events, n)
    except BaseException:
        await events.aclose()
        raise


async def _replay(first: list[Event], events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """The buffered first events, then the rest; closing it closes ``events`` (which
    cancels the choices still running: the client went away)."""
    try:
        for ev in first:
            yield ev
        async for ev in events:
            yield ev
    finally:
        await events.aclose()


async def _collect(fe: Frontend, events: AsyncIterator[Event], n: int, request: Request) -> list[Choice]:
    """Every choice to its end; a client that goes away meanwhile cancels them."""
    choices = [Choice(i) for i in range(n)]

    async def consume() -> None:
        async for ev in events:
            if ev.error is not None:
                raise ev.error
            choices[ev.index].add(ev.response, fe.checkpoint.tokenizer)

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                raise OpenAIError(CLIENT_GONE, "the client closed the connection", code="client_closed")
        task.result()
        return choices
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await events.aclose()


def _usage(choices: list[Choice], n: int) -> Usage:
    # the prompt counts once per prompt (the first choice of each), as OpenAI counts it
    prompt = sum(c.prompt_tokens for c in choices if c.index % n == 0)
    cached = [c.cached_tokens for c in choices if c.index % n == 0 and c.cached_tokens is not None]
    return Usage.of(prompt, sum(c.completion_tokens for c in choices), sum(cached) if cached else None)


def _count_tokens(fe: Frontend, endpoint: str, choices: list[Choice], n: int) -> None:
    usage = _usage(choices, n)
    fe.metrics.prompt_tokens.labels(endpoint).inc(usage.prompt_tokens)
    fe.metrics.completion_tokens.labels(endpoint).inc(usage.completion_tokens)


def _first_token(fe: Frontend, endpoint: str, t0: float, choices: list[Choice]) -> None:
    if sum(bool(c.parts) for c in choices) == 1 and sum(len(c.parts) for c in choices) == 1:
        fe.metrics.ttft.labels(endpoint).observe(time.perf_counter() - t0)


def _stream_error(fe: Frontend, endpoint: str, exc: BaseException) -> str:
    fe.metrics.errors.labels(endpoint, "stream").inc()
    return error_event(exc)


def _sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":   # its loc is a byte offset, not a field
            error = (first.get("ctx") or {}).get("error", "")
            message = f"the request body is not valid JSON ({error}; at character {first['loc'][-1]})"
            return JSONResponse(OpenAIError(400, message, code="invalid_json").body(), status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first["msg"].removeprefix("Value error, ")   # our validators' own messages
        message = f"{param}: {msg}" if param else msg
        if "input" in first and param and not isinstance(first["input"], (dict, list)):
            message += f" (got {first['input']!r})"
        return JSONResponse(OpenAIError(400, message, param=param, code="invalid_value").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(OpenAIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        return JSONResponse(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").body(),
                            status_code=500)
