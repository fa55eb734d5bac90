"""The benchmarks' one request client (as vLLM's ``benchmarks/backend_request_func.py``):
a :class:`RequestInput` goes out as an OpenAI stream (``/v1/completions`` or
``/v1/chat/completions``) or over a Triton gRPC stream, and comes back as a
:class:`RequestOutput`, the same for both: when each chunk of output arrived and its
tokens, the text, the server's token counts, an error.

The OpenAI client is the standard library only (asyncio sockets; :mod:`.sse` parses
the bytes), so that it costs every server the same and adds no dependency. The gRPC
client multiplexes every request over one stream, as a client of the ensemble does.

>>> inp = RequestInput("def f():", 16, kind="cold", min_tokens=16)
>>> openai_body(inp)["min_tokens"], openai_body(inp, chat=True)["messages"]
(16, [{'role': 'user', 'content': 'def f():'}])
>>> out = RequestOutput("cold", chunk_s=[0.1, 0.15, 0.3], output_tokens=4)
>>> out.ttft_s, [round(g, 2) for g in out.itl_s], out.tokens
(0.1, [0.05, 0.15], 4)
>>> asyncio.run(openai_completion("127.0.0.1", 8000, inp))     # doctest: +SKIP
RequestOutput(kind='cold', ...)
"""
from __future__ import annotations

import asyncio
import itertools
import json
import queue
import time
from dataclasses import dataclass, field

from tandem.client.bench.sse import ChunkedDecoder, SSEParser, parse_event


@dataclass(slots=True, frozen=True)
class RequestInput:
    """One greedy streamed request of at most ``max_tokens`` tokens (exactly that many
    with ``min_tokens`` = ``max_tokens``)."""
    prompt: str
    max_tokens: int
    kind: str = "request"              # the benchmark's label: "cold", "long", "first", ...
    model: str = "tandem"
    min_tokens: int | None = None
    ignore_eos: bool = False           # vLLM: min_tokens alone still stops at a stop string
    prompt_tokens: int | None = None   # the prompt's length as the benchmark cut it


@dataclass(slots=True)
class RequestOutput:
    """One request's timeline. ``chunk_s``: when each SSE chunk or gRPC response that
    brought output arrived, in seconds after ``start``; ``chunk_tokens``: the new tokens
    each brought, where the protocol says so (gRPC's ``num_output_tokens``; an SSE
    chunk gives text, not a count)."""
    kind: str = "request"
    request_id: str = ""
    start: float = 0.0                 # time.perf_counter() when sent
    end: float | None = None           # when it ended (None: still running)
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int | None = None   # the server's count (the usage's completion_tokens; gRPC's so far)
    prompt_tokens: int | None = None   # the usage's; else the input's
    cached_tokens: int | None = None   # usage.prompt_tokens_details.cached_tokens, when reported
    responses: int = 0                 # gRPC responses with outputs: fewer than tokens where they coalesce
    text: str = ""                     # the reply, which a chat client sends back in its next turn
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def itl_s(self) -> list[float]:
        """The gaps between chunks, as a user sees them (however many tokens each brought)."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tokens(self) -> int:
        """The server's count; the chunks' when the server sent none."""
        if self.output_tokens is not None:
            return self.output_tokens
        return sum(self.chunk_tokens) if self.chunk_tokens else len(self.chunk_s)

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first chunk over the time they took (None with fewer than
        two chunks, or without counts per chunk)."""
        if len(self.chunk_s) < 2 or not self.chunk_tokens:
            return None
        span = self.chunk_s[-1] - self.chunk_s[0]
        return sum(self.chunk_tokens[1:]) / span if span > 0 else None


# -- OpenAI: server-sent events over HTTP/1.1 ---------------------------------------------
def openai_body(inp: RequestInput, chat: bool = False) -> dict:
    """``inp`` as the JSON of a greedy stream that ends with its usage (the token counts)."""
    prompt = {"messages": [{"role": "user", "content": inp.prompt}]} if chat else {"prompt": inp.prompt}
    body = {"model": inp.model, **prompt, "max_tokens": inp.max_tokens}
    if inp.min_tokens is not None:
        body["min_tokens"] = inp.min_tokens
    body |= {"temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if inp.ignore_eos:
        body["ignore_eos"] = True
    return body


async def openai_completion(host: str, port: int, inp: RequestInput, timeout_s: float = 600.0) -> RequestOutput:
    """``inp`` as a streamed ``/v1/completions``, its chunks timed."""
    return await _openai_stream(host, port, "/v1/completions", openai_body(inp), inp, timeout_s)


async def openai_chat(host: str, port: int, inp: RequestInput, timeout_s: float = 600.0) -> RequestOutput:
    """``inp``'s prompt as the one user message of a streamed ``/v1/chat/completions``."""
    return await _openai_stream(host, port, "/v1/chat/completions", openai_body(inp, chat=True), inp, timeout_s)


def request_bytes(host: str, port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
            ).encode() + data


async def _openai_stream(host: str, port: int, path: str, body: dict, inp: RequestInput,
                         timeout_s: float) -> RequestOutput:
    # a fresh connection each: on loopback it costs well under a millisecond, and no pool
    # state skews a server
    out = RequestOutput(inp.kind, start=time.perf_counter(), prompt_tokens=inp.prompt_tokens)
    try:
        await asyncio.wait_for(_read_stream(host, port, request_bytes(host, port, path, body), out), timeout_s)
    except (OSError, EOFError, asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError) as exc:
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    out.end = time.perf_counter()
    return out


async def _read_stream(host: str, port: int, request: bytes, out: RequestOutput) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        chunked = b"transfer-encoding: chunked" in head.lower()
        if status != b"200":
            rest = await reader.read()
            out.error = f"HTTP {status.decode()}: {rest[-300:].decode(errors='replace')}"
            return
        sse, dechunk = SSEParser(), ChunkedDecoder() if chunked else None
        while True:
            data = await reader.read(65536)
            if not data:
                return
            now = time.perf_counter()
            for payload in sse.feed(dechunk.feed(data) if dechunk else data):
                ev = parse_event(payload)
                if ev is None:
                    return
                if ev.error:
                    out.error = ev.error
                    return
                if ev.text:
                    out.chunk_s.append(now - out.start)
                    out.text += ev.text
                if ev.completion_tokens is not None:
                    out.output_tokens = ev.completion_tokens
                    out.prompt_tokens, out.cached_tokens = ev.prompt_tokens, ev.cached_tokens
            if dechunk and dechunk.done:
                return
    finally:
        writer.close()


# -- Triton: one gRPC stream ----------------------------------------------------------------
class TritonStream:
    """Requests to ``model`` multiplexed over one gRPC stream, timed as their responses
    arrive (on the stream's thread). ``finished`` gets each request's output as it ends,
    and for an error response an output with only its ``error`` (the stream does not say
    whose request it was; ``errors`` lists them too).

    >>> stream = TritonStream(server.grpc_url, "tandem")                   # doctest: +SKIP
    >>> rid = stream.send(RequestInput("def f():", 32, kind="long"))       # doctest: +SKIP
    >>> stream.wait(1, timeout_s=60)[0].ttft_s                             # doctest: +SKIP
    0.041
    """

    def __init__(self, url: str, model: str):
        import tritonclient.grpc as grpcclient
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self.outputs: dict[str, RequestOutput] = {}
        self.errors: list[str] = []
        self.finished: queue.Queue[RequestOutput] = queue.Queue()
        self._ids = itertools.count()
        self.client.start_stream(callback=self._on_response)

    def send(self, inp: RequestInput) -> str:
        """Send ``inp``; its request id (its output is ``outputs[id]``)."""
        from tandem.client.generate import build_inputs
        rid = f"{inp.kind}-{next(self._ids)}"
        self.outputs[rid] = RequestOutput(inp.kind, rid, start=time.perf_counter(), prompt_tokens=inp.prompt_tokens)
        inputs = build_inputs(inp.prompt, max_tokens=inp.max_tokens, min_tokens=inp.min_tokens, stream=True,
                              temperature=0.0)
        self.client.async_stream_infer(self.model, inputs, request_id=rid, enable_empty_final_response=True)
        return rid

    def _on_response(self, result, error) -> None:
        now = time.perf_counter()
        if error is not None:
            self.errors.append(str(error))
            self.finished.put(RequestOutput("error", end=now, error=str(error)))
            return
        from tandem.client.generate import parse_response
        r = parse_response(result)
        response = result.get_response()
        out = self.outputs.get(response.id)
        if out is None:
            return
        if response.outputs:
            out.responses += 1
        new = r.num_output_tokens - (out.output_tokens or 0)   # the count so far, not the response's own
        if new > 0:
            out.chunk_s.append(now - out.start)
            out.chunk_tokens.append(new)
            out.output_tokens = r.num_output_tokens
        out.text += r.text
        if r.final:
            out.end = now
            self.finished.put(out)

    def wait(self, n: int, timeout_s: float) -> list[RequestOutput]:
        """The next ``n`` outputs to end (error ones among them); ``TimeoutError`` when
        they take longer than ``timeout_s`` in all."""
        deadline = time.perf_counter() + timeout_s
        try:
            return [self.finished.get(timeout=max(0.0, deadline - time.perf_counter())) for _ in range(n)]
        except queue.Empty:
            raise TimeoutError(f"{n} requests did not end in {timeout_s:.0f} s") from None

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()
