"""Turn one request's engine outputs into Triton responses, without Triton.

A :class:`ResponseStream` receives the engine's ``RequestOutput`` objects (on
the engine thread) and cancellation or failure (from other threads), and
hands :class:`Reply` objects to a ``send`` callable. It guarantees what a
decoupled client relies on: exactly one reply carries ``final``, nothing is
sent after it, and it is sent on every path: finished, failed or cancelled.

A request with ``num_return_sequences`` n is n engine requests (sequences); each
reply carries its ``sequence_index``, and ``final`` comes with the last sequence's end.

- ``stream=True``: one reply per engine step that produced tokens (several with
  speculation); a sequence's last one carries its finish reason. The engine models
  send through a :class:`~.reply_pump.ReplyPump`, which merges the replies of steps
  that queued up behind a busy sender.
- ``stream=False``: a single reply per sequence with every token and the whole text;
  with one sequence that is the one reply Triton's HTTP ``generate`` endpoint requires.

A sequence that fails ends the whole stream with its error (the model aborts the
others: :meth:`ResponseStream.unfinished`).

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

from .generate_request import GenerateRequest
from .response_arrays import PromptReply, SequenceReply, engine_arrays


@dataclass(slots=True, frozen=True)
class Reply:
    """Tokens (``sequence``, with the ``relay`` arrays), an error, or the bare final flag."""
    sequence: SequenceReply | None = None
    relay: dict[str, np.ndarray] | None = None
    error: str | None = None
    code: str = "INVALID_ARG"  # Triton error code: INVALID_ARG, CANCELLED, INTERNAL, UNAVAILABLE
    final: bool = False

    @property
    def outputs(self) -> dict[str, np.ndarray] | None:
        """The response's tensors (built when sent: merged replies build them once)."""
        if self.sequence is None:
            return None
        return {**engine_arrays(self.sequence), **(self.relay or {})}


class _Sequence:
    __slots__ = ("done", "ids", "text", "log_probs", "top", "prompt")

    def __init__(self):
        self.done = False
        self.ids: list[int] = []      # accumulated for stream=False
        self.text: list[str] = []
        self.log_probs: list[float] = []
        self.top: list = []           # engine TopLogprobs, one per token
        self.prompt = None            # engine PromptLogprobs


class ResponseStream:
    def __init__(self, request: GenerateRequest, send: Callable[[Reply], None],
                 relay: dict[str, np.ndarray] | None = None):
        self.request = request
        self._send = send
        self._relay = relay or {}
        self._lock = threading.Lock()
        self._closed = False
        self._seqs = [_Sequence() for _ in range(request.num_return_sequences)]

    @property
    def closed(self) -> bool:
        return self._closed

    def unfinished(self) -> list[int]:
        """The sequences the engine has not finished (to abort when the stream ended early)."""
        return [i for i, seq in enumerate(self._seqs) if not seq.done]

    def on_output(self, out, index: int = 0) -> None:
        """Handle one engine ``RequestOutput`` of sequence ``index`` (engine thread)."""
        with self._lock:
            seq = self._seqs[index]
            if out.finished:
                seq.done = True
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
            log_probs = (getattr(out, "new_logprobs", None) or []) if self.request.return_log_probs else []
            top = getattr(out, "new_top_logprobs", None) or []
            prompt = getattr(out, "prompt_logprobs", None)
            if self.request.stream:
                ids, text = out.new_token_ids, out.new_text
            else:
                seq.ids.extend(out.new_token_ids)
                seq.text.append(out.new_text)
                seq.log_probs.extend(log_probs)
                seq.top.extend(top)
                seq.prompt = seq.prompt or prompt
                if not out.finished:
                    return
                ids, text, log_probs, top, prompt = seq.ids, "".join(seq.text), seq.log_probs, seq.top, seq.prompt
            cum = float(getattr(out, "cumulative_logprob", None) or 0.0) if self.request.return_log_probs else 0.0
            reply = SequenceReply(
                token_ids=list(ids), text=text, finish_reason=(out.finish_reason or "stop") if out.finished else None,
                num_input_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                sequence_index=index, log_probs=list(log_probs), cum_log_prob=cum,
                top_ids=[t.token_ids for t in top], top_log_probs=[t.logprobs for t in top],
                prompt=None if prompt is None else PromptReply.of(prompt),
                num_cached_tokens=getattr(out, "num_cached_tokens", 0),
                perf=getattr(out, "perf", None) if self.request.return_perf_metrics else None)
            final = not self.unfinished()
            self._emit(Reply(sequence=reply, relay=self._relay, final=final))

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
