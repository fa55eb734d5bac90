"""An OpenAI stream's bytes to its events, whatever the bytes' split: the HTTP/1.1
chunked body, the server-sent events in it, and what each event's JSON says for choice
0 (``/v1/completions``' ``text`` or ``/v1/chat/completions``' ``delta.content``, the
usage, an error). Pure: the request client (:mod:`.request_client`) feeds it what the
socket reads.

>>> p = SSEParser(); p.feed(b'data: {"choices": [{"text": "a"}]}\\n\\nda')
['{"choices": [{"text": "a"}]}']
>>> p.feed(b'ta: [DONE]\\n\\n')
['[DONE]']
>>> parse_event('{"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}')
Event(text='hi', finish_reason=None, completion_tokens=None, error=None, prompt_tokens=None, cached_tokens=None)
"""
from __future__ import annotations

import json
from dataclasses import dataclass


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
    """What a stream's chunk says for choice 0."""
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None     # usage.prompt_tokens_details.cached_tokens, when reported


def parse_event(payload: str) -> Event | None:
    """A chunk's payload (vLLM's and Tandem's alike, completions and chat) as an
    :class:`Event`; None at ``[DONE]``."""
    if payload.strip() == "[DONE]":
        return None
    obj = json.loads(payload)
    if "error" in obj:   # an error sent inside the stream, after the 200
        err = obj["error"]
        return Event(error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
    ev = Event()
    for choice in obj.get("choices") or []:
        if choice.get("index", 0) == 0:
            # completions carry "text"; chat a "delta" (its first one the role, with no content)
            ev.text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            ev.finish_reason = choice.get("finish_reason")
    usage = obj.get("usage")
    if usage:
        ev.completion_tokens = usage.get("completion_tokens")
        ev.prompt_tokens = usage.get("prompt_tokens")
        ev.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return ev
