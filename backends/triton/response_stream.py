"""Turn one request's engine outputs into Triton responses, without Triton.

A :class:`ResponseStream` receives the engine's ``RequestOutput`` objects (on
the engine thread) and cancellation or failure (from other threads), and
hands :class:`Reply` objects to a ``send`` callable. It guarantees what a
decoupled client relies on: exactly one reply carries ``final``, nothing is
sent after it, and it is sent on every path: finished, failed or cancelled.

- ``stream=True``: one reply per engine step that produced tokens (several with
  speculation); the last one carries the finish reason and ``final``.
- ``stream=False``: a single reply with every token and the whole text, and
  ``final``, which Triton's HTTP ``generate`` endpoint requires.

Replies carry token-level outputs (``output_ids`` and the text delta), plus the
``relay`` arrays the model attaches to every reply for the ensemble's next step
(``cancel_token``, ``prompt_echo``); the prompt echo of a non-streaming text
request is ``postprocess``'s business, so the engine never reads the prompt's text.

>>> sent = []
>>> s = ResponseStream(GenerateRequest([5, 6], stream=True), sent.append)
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

from .generate_request import GenerateRequest, token_output_arrays


@dataclass(slots=True, frozen=True)
class Reply:
    outputs: dict[str, np.ndarray] | None = None
    error: str | None = None
    code: str = "INVALID_ARG"  # Triton error code: INVALID_ARG, CANCELLED, INTERNAL, UNAVAILABLE
    final: bool = False


class ResponseStream:
    def __init__(self, request: GenerateRequest, send: Callable[[Reply], None],
                 relay: dict[str, np.ndarray] | None = None):
        self.request = request
        self._send = send
        self._relay = relay or {}
        self._lock = threading.Lock()
        self._closed = False
        self._ids: list[int] = []    # accumulated for stream=False
        self._text: list[str] = []

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
                # e.g. the prompt's KV never arrived (the reason names why)
                what = getattr(out, "error", None) or "the engine step failed; request aborted"
                code = getattr(out, "error_code", None) or "INTERNAL"
                prefix = "unavailable" if code == "UNAVAILABLE" else "internal error"
                self._end(Reply(error=f"{prefix}: {what}", code=code, final=True))
                return
            if self.request.stream:
                ids, text = out.new_token_ids, out.new_text
            else:
                self._ids.extend(out.new_token_ids)
                self._text.append(out.new_text)
                if not out.finished:
                    return
                ids, text = self._ids, "".join(self._text)
            reason = (out.finish_reason or "stop") if out.finished else None
            arrays = token_output_arrays(ids, text, reason, out.num_prompt_tokens, out.num_output_tokens)
            self._emit(Reply(outputs={**arrays, **self._relay}, final=out.finished))

    def client_cancelled(self, is_cancelled: Callable[[], bool]) -> bool:
        """Ask Triton (``is_cancelled``) whether the client cancelled this open stream.

        Never once the final reply went out, nor while it goes out: the Python backend
        frees a decoupled request's response factory with the final response, and asking
        it afterwards reads freed memory — the server crashes. The lock keeps the two apart.
        """
        with self._lock:
            if self._closed:
                return False
            try:
                return bool(is_cancelled())
            except Exception:  # the request is gone on the server side
                return True

    def fail(self, message: str, code: str = "INVALID_ARG") -> bool:
        """End the stream with an error reply; False if it had already ended."""
        with self._lock:
            return self._end(Reply(error=message, code=code, final=True))

    def cancel(self, message: str = "request cancelled by the client", notify: bool = True) -> bool:
        """End the stream as cancelled; False if it had already ended. ``notify`` False
        sends the bare final flag instead of a CANCELLED error (see :mod:`.in_flight`)."""
        with self._lock:
            return self._end(Reply(error=message, code="CANCELLED", final=True) if notify else Reply(final=True))

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
