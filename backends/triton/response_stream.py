"""Turn one request's engine outputs into Triton responses, without Triton.

A :class:`ResponseStream` receives the engine's ``RequestOutput`` objects (on
the engine thread) and cancellation or failure (from other threads), and
hands :class:`Reply` objects to a ``send`` callable. It guarantees what a
decoupled client relies on: exactly one reply carries ``final``, nothing is
sent after it, and it is sent on every path: finished, failed or cancelled.

- ``stream=True``: one reply per engine step that produced tokens; the last
  one carries the finish reason and ``final``.
- ``stream=False``: a single reply with the whole text and ``final``, which
  Triton's HTTP ``generate`` endpoint requires.

>>> sent = []
>>> s = ResponseStream(GenerateRequest("hi", stream=True), sent.append)
>>> s.cancel()
True
>>> sent[0].final, sent[0].code
(True, 'CANCELLED')
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .generate_request import GenerateRequest, output_arrays


@dataclass(slots=True, frozen=True)
class Reply:
    outputs: dict[str, np.ndarray] | None = None
    error: str | None = None
    code: str = "INVALID_ARG"  # Triton error code: INVALID_ARG, CANCELLED, INTERNAL, UNAVAILABLE
    final: bool = False


class ResponseStream:
    def __init__(self, request: GenerateRequest, send: Callable[[Reply], None]):
        self.request = request
        self._send = send
        self._lock = threading.Lock()
        self._closed = False
        self._text: list[str] = []   # accumulated for stream=False

    @property
    def closed(self) -> bool:
        return self._closed

    def on_output(self, out) -> None:
        """Handle one engine ``RequestOutput`` (engine thread)."""
        with self._lock:
            if self._closed:
                return
            if not out.finished and not out.new_token_ids:
                return
            if out.finished and out.finish_reason == "error":
                self._end(Reply(error="internal error: the engine step failed; request aborted",
                                code="INTERNAL", final=True))
                return
            if self.request.stream:
                text = out.new_text
            else:
                self._text.append(out.new_text)
                if not out.finished:
                    return
                text = "".join(self._text)
                if not self.request.exclude_input_in_output:
                    text = self.request.prompt + text
            reason = (out.finish_reason or "stop") if out.finished else None
            arrays = output_arrays(text, reason, out.num_prompt_tokens, out.num_output_tokens)
            self._emit(Reply(outputs=arrays, final=out.finished))

    def fail(self, message: str, code: str = "INVALID_ARG") -> bool:
        """End the stream with an error reply; False if it had already ended."""
        with self._lock:
            return self._end(Reply(error=message, code=code, final=True))

    def cancel(self, message: str = "request cancelled by the client") -> bool:
        """End the stream as cancelled; False if it had already ended."""
        with self._lock:
            return self._end(Reply(error=message, code="CANCELLED", final=True))

    def _end(self, reply: Reply) -> bool:
        if self._closed:
            return False
        self._emit(reply)
        return True

    def _emit(self, reply: Reply) -> None:
        send = self._send
        if reply.final:
            self._closed = True
            # Let go of the sender (and through it the Triton request) as soon
            # as the stream ends, whoever still holds this object.
            self._send = None
        send(reply)
