"""One load generator for any OpenAI-compatible server: streaming ``/v1/completions``
requests in a closed loop at a fixed concurrency, timed as they arrive, with the
standard library only (asyncio sockets, HTTP/1.1 chunked bodies, server-sent events),
so that the client costs every server the same and adds no dependency.

Per request it records the time to the first text, the gap before every later
chunk that carries text, the reply's text, and the completion, prompt and cached prompt
tokens the final usage chunk reports.

>>> p = SSEParser(); p.feed(b'data: {"choices": [{"text": "a"}]}\\n\\nda')
['{"choices": [{"text": "a"}]}']
>>> p.feed(b'ta: [DONE]\\n\\n')
['[DONE]']
>>> parse_event('{"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}')
Event(text='hi', finish_reason=None, completion_tokens=None, error=None, prompt_tokens=None, cached_tokens=None)
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field


class SSEParser:
    """Server-sent events to their ``data`` payloads, whatever the bytes' split."""

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf = (self._buf + data).replace(b"\r\n", b"\n")   # a CRLF may be split
        out = []
        while b"\n\n" in self._buf:
            block, self._buf = self._buf.split(b"\n\n", 1)
            lines = [ln[5:].removeprefix(b" ") for ln in block.split(b"\n") if ln.startswith(b"data:")]
            if lines:   # comments (":") and other fields carry no payload
                out.append(b"\n".join(lines).decode())
        return out


class ChunkedDecoder:
    """An HTTP/1.1 ``Transfer-Encoding: chunked`` body to its bytes; ``done`` after the
    last (empty) chunk.

    >>> d = ChunkedDecoder(); d.feed(b"3\\r\\nabc\\r\\n0\\r\\n\\r\\n"), d.done
    (b'abc', True)
    """

    def __init__(self):
        self._buf, self._need, self.done = b"", None, False

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = b""
        while not self.done:
            if self._need is None:
                if b"\r\n" not in self._buf:
                    break
                size, self._buf = self._buf.split(b"\r\n", 1)
                self._need = int(size.split(b";")[0], 16)
            if len(self._buf) < self._need + 2:
                break
            out += self._buf[:self._need]
            self._buf, last, self._need = self._buf[self._need + 2:], self._need == 0, None
            self.done = last
        return out


@dataclass(slots=True)
class Event:
    """What a completions stream's chunk says for choice 0."""
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None     # usage.prompt_tokens_details.cached_tokens, when reported


def parse_event(payload: str) -> Event | None:
    """A chunk's payload (vLLM's and Tandem's alike) as an :class:`Event`; None at
    ``[DONE]``."""
    if payload.strip() == "[DONE]":
        return None
    obj = json.loads(payload)
    if "error" in obj:   # an error sent inside the stream, after the 200
        err = obj["error"]
        return Event(error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
    ev = Event()
    for choice in obj.get("choices") or []:
        if choice.get("index", 0) == 0:
            ev.text = choice.get("text") or ""
            ev.finish_reason = choice.get("finish_reason")
    usage = obj.get("usage")
    if usage:
        ev.completion_tokens = usage.get("completion_tokens")
        ev.prompt_tokens = usage.get("prompt_tokens")
        ev.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return ev


@dataclass(slots=True)
class StreamResult:
    """One request's timeline: ``chunk_s`` are arrival times (s after ``start``) of
    the chunks that carried text."""
    kind: str
    start: float = 0.0
    end: float = 0.0
    chunk_s: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""           # the reply, which a chat client sends back in its next turn

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def tokens(self) -> int:
        """The usage's count; the text chunks' when the server sent no usage."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_s)


def request_bytes(host: str, port: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
            ).encode() + data


async def stream_completion(host: str, port: int, body: dict, kind: str, timeout_s: float = 600.0) -> StreamResult:
    """Send one streaming completion and time its chunks (a fresh connection each:
    on loopback it costs well under a millisecond, and no pool state skews a server)."""
    res = StreamResult(kind, start=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(host, port, body, res), timeout_s)
    except (OSError, EOFError, asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError) as exc:
        res.error = res.error or f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    return res


async def _stream(host: str, port: int, body: dict, res: StreamResult) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request_bytes(host, port, body))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        chunked = b"transfer-encoding: chunked" in head.lower()
        if status != b"200":
            rest = await reader.read()
            res.error = f"HTTP {status.decode()}: {rest[-300:].decode(errors='replace')}"
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
                    res.error = ev.error
                    return
                if ev.text:
                    res.chunk_s.append(now - res.start)
                    res.text += ev.text
                if ev.completion_tokens is not None:
                    res.completion_tokens = ev.completion_tokens
                    res.prompt_tokens, res.cached_tokens = ev.prompt_tokens, ev.cached_tokens
            if dechunk and dechunk.done:
                return
    finally:
        writer.close()


async def closed_loop(host: str, port: int, requests: list[tuple[str, dict]], concurrency: int
                      ) -> tuple[list[StreamResult], float]:
    """``requests`` (kind, body), ``concurrency`` at a time, each next one sent as one
    ends; the results in order and the wall time from the first send to the last end."""
    pending = list(enumerate(requests))
    out: list[StreamResult | None] = [None] * len(requests)

    async def worker():
        while pending:
            i, (kind, body) = pending.pop(0)
            out[i] = await stream_completion(host, port, body, kind)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return out, time.perf_counter() - t0


def run_closed_loop(host: str, port: int, requests: list[tuple[str, dict]], concurrency: int):
    return asyncio.run(closed_loop(host, port, requests, concurrency))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None of nothing.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([5.0], 99), percentile([], 50)
    (2.5, 5.0, None)
    """
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def summarize(results: list[StreamResult], wall_s: float) -> dict:
    """A level's figures: output tok/s (all completion tokens over the wall time), TTFT
    p50/p99 of each kind of prompt, ITL p50/p99 (gaps between text chunks, as a user
    sees them), TPOT p50 (a request's (end - TTFT) / (tokens - 1): per token, however
    many a chunk carried), tokens per chunk, requests and errors."""
    ok = [r for r in results if r.error is None and r.chunk_s]
    gaps = [b - a for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    tpot = [(r.chunk_s[-1] - r.chunk_s[0]) / (r.tokens - 1) for r in ok if r.tokens > 1]
    tokens = sum(r.tokens for r in ok)
    out = {"requests": len(results), "errors": len(results) - len(ok),
           "output_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
           "completion_tokens_mean": round(tokens / len(ok), 1) if ok else None,
           "tokens_per_chunk": round(tokens / sum(len(r.chunk_s) for r in ok), 3) if ok else None,
           "itl_ms_p50": _ms(percentile(gaps, 50)), "itl_ms_p99": _ms(percentile(gaps, 99)),
           "tpot_ms_p50": _ms(percentile(tpot, 50))}
    for kind in sorted({r.kind for r in results}):
        ttft = [r.ttft_s for r in ok if r.kind == kind]
        out[f"ttft_{kind}_ms_p50"] = _ms(percentile(ttft, 50))
        out[f"ttft_{kind}_ms_p99"] = _ms(percentile(ttft, 99))
    errors = [r.error for r in results if r.error]
    if errors:
        out["first_error"] = errors[0][:300]
    return out
