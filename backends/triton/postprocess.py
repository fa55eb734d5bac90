"""The prompt echo and the ``postprocess`` step's rules, without Triton.

An engine reply (``llm`` or ``decode``: the text delta, finish reason, token counts,
``output_ids``) becomes one ensemble response. The engine models stream token-level
replies and never read the prompt's text; the prompt echo of TensorRT-LLM's
ensemble happens here: a request that is not streamed (one reply with the whole
text) and does not set ``exclude_input_in_output`` gets text that starts with the
prompt. Streaming never repeats it.

Triton refuses an ensemble step that takes tensors from a decoupled step *and*
tensors from before it ("inputs originated from different decoupled models"), so
postprocess cannot read ``text_input``, ``stream`` or ``exclude_input_in_output``
itself. ``preprocess`` therefore evaluates :func:`prompt_echo` and the engine model
relays the result unread (``prompt_echo``) to postprocess, which puts it first.

>>> prompt_echo(GenerateRequest("x =", stream=False))
'x ='
>>> reply = {"text_output": np.array([[b" 1"]], dtype=object),
...          "finish_reason": np.array([[b"length"]], dtype=object),
...          "num_input_tokens": np.array([[3]], dtype=np.uint32),
...          "num_output_tokens": np.array([[1]], dtype=np.uint32),
...          "prompt_echo": np.array([[b"x ="]], dtype=object)}
>>> ensemble_outputs(reply.get)["text_output"][0]
b'x = 1'
"""
from __future__ import annotations

import numpy as np

from .generate_request import GenerateRequest, GetInput, RequestError, as_text, scalar
from .perf_outputs import perf_from
from .response_arrays import SequenceReply, ensemble_arrays, logprobs_from

PROMPT_ECHO = "prompt_echo"     # STRING [1, 1]: preprocess -> llm/decode (relayed) -> postprocess


def prompt_echo(request: GenerateRequest) -> str:
    """The text a response starts with before the generated text (TensorRT-LLM's rule)."""
    if request.stream or request.exclude_input_in_output or not isinstance(request.prompt, str):
        return ""
    return request.prompt


def ensemble_outputs(get: GetInput) -> dict[str, np.ndarray]:
    """The ensemble's outputs (:mod:`.response_arrays`) for one engine reply; ``output_ids``
    passes through when given (``tandem_tokens``); absent log probs and index read as
    none and 0."""
    text = as_text(_required(get, "text_output"), "text_output")
    echo = scalar(get, PROMPT_ECHO)
    if echo is not None:
        text = as_text(echo, PROMPT_ECHO) + text
    ids = get("output_ids")
    log_probs = get("output_log_probs")
    cum = scalar(get, "cum_log_probs")
    index = scalar(get, "sequence_index")
    num_cached, perf = perf_from(get)
    top_ids, top_log_probs, prompt = logprobs_from(get)
    reply = SequenceReply(
        token_ids=[] if ids is None else [int(t) for t in np.asarray(ids).reshape(-1)],
        text=text, finish_reason=as_text(_required(get, "finish_reason"), "finish_reason"),
        num_input_tokens=int(_required(get, "num_input_tokens")),
        num_output_tokens=int(_required(get, "num_output_tokens")),
        sequence_index=0 if index is None else int(index),
        log_probs=[] if log_probs is None else np.asarray(log_probs, dtype=np.float32).reshape(-1).tolist(),
        cum_log_prob=0.0 if cum is None else float(cum), top_ids=top_ids, top_log_probs=top_log_probs,
        prompt=prompt, num_cached_tokens=num_cached, perf=perf)
    return ensemble_arrays(reply, with_ids=ids is not None)


class CancelChecks:
    """Whether postprocess asks Triton about a reply's cancellation: at most once per
    ``interval_s`` per stream (its cancel token). Each ask is a round trip from the stub
    to the server; a stream's replies come every few milliseconds, and a cancellation
    is still seen by the first reply after the interval (the first reply of a stream is
    always asked). ``None`` (no token) is always asked.

    >>> t = [0.0]
    >>> checks = CancelChecks(0.05, now=lambda: t[0])
    >>> checks.due(b"a"), checks.due(b"a"), checks.due(b"b")
    (True, False, True)
    >>> t[0] = 0.06
    >>> checks.due(b"a")
    True
    """

    def __init__(self, interval_s: float = 0.05, now=None, max_streams: int = 4096):
        import time
        self.interval_s = interval_s
        self._now = now or time.monotonic
        self._max = max_streams
        self._last: dict[bytes, float] = {}

    def due(self, token: bytes | None) -> bool:
        if token is None or self.interval_s <= 0:
            return True
        now = self._now()
        last = self._last.get(token)
        if last is not None and now - last < self.interval_s:
            return False
        self._last[token] = now
        if len(self._last) > self._max:   # ended streams: forget the least recently asked
            for old in sorted(self._last, key=self._last.get)[:len(self._last) // 2]:
                del self._last[old]
        return True


def _required(get: GetInput, name: str):
    value = scalar(get, name)
    if value is None:
        raise RequestError(name, "is required (an output of the llm or decode model)")
    return value
