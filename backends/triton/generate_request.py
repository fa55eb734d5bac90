"""The ``tandem`` model's request and response tensors, without Triton.

The interface is the TensorRT-LLM backend's (``text_input``, ``max_tokens``,
``stream``, ... in; ``text_output`` out), so its clients, ``perf_analyzer``
and Triton's HTTP ``generate``/``generate_stream`` endpoints work unchanged.
Every tensor carries the batch dimension (``max_batch_size: 1``), so a client
sends ``text_input`` with shape ``[1, 1]``.

Inputs and defaults (all but ``text_input`` optional):

==========================  ======  ===========  ==========================================
name                        type    default      allowed
==========================  ======  ===========  ==========================================
text_input                  STRING  (required)   non-empty UTF-8 text
max_tokens                  INT32   16           >= 1
stream                      BOOL    false        true: one response per engine step
temperature                 FP32    1.0          >= 0; 0 = greedy
top_p                       FP32    1.0          [0, 1]; 0 or 1 = no nucleus filter
top_k                       INT32   0            >= 0; 0 = no top-k filter
seed                        UINT64  (random)     any (``random_seed`` is accepted too)
stop_words                  STRING  none         non-empty strings; text stops before them
end_id                      INT32   model's EOS  a token id; replaces the EOS token
exclude_input_in_output     BOOL    false        false: non-streaming text starts with
                                                 the prompt (as in TensorRT-LLM);
                                                 streaming never repeats the prompt
==========================  ======  ===========  ==========================================

Outputs: ``text_output`` (STRING), ``finish_reason`` (STRING: ``""`` until the
last response, then ``stop``, ``length`` or ``abort``), ``num_input_tokens``
and ``num_output_tokens`` (UINT32, cumulative).

>>> inputs = {"text_input": np.array([[b"def f():"]], dtype=object),
...           "max_tokens": np.array([[8]], dtype=np.int32)}
>>> req = parse_generate_request(inputs.get)
>>> (req.prompt, req.max_tokens, req.stream)
('def f():', 8, False)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

INPUT_NAMES = ("text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed",
               "random_seed", "stop_words", "end_id", "exclude_input_in_output")
OUTPUT_NAMES = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")

GetInput = Callable[[str], "np.ndarray | None"]


class RequestError(ValueError):
    """A user error in one input; the message names the field and what is allowed."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


@dataclass(slots=True)
class GenerateRequest:
    prompt: str
    max_tokens: int = 16
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_words: list[str] = field(default_factory=list)
    end_id: int | None = None
    exclude_input_in_output: bool = False

    def sampling_params(self):
        """The engine's ``SamplingParams`` for this request."""
        from tandem.backends.engine.params import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop_words),
            stop_token_ids=[] if self.end_id is None else [self.end_id],
            # end_id replaces the model's EOS, as TensorRT-LLM's end_id does
            ignore_eos=self.end_id is not None,
        )


def _scalar(get: GetInput, name: str):
    arr = get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise RequestError(name, f"expected one value, got {flat.size} (shape {list(np.shape(arr))})")
    return flat[0]


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return str(value)


def _int(get: GetInput, name: str, default, minimum: int, allowed: str):
    value = _scalar(get, name)
    if value is None:
        return default
    value = int(value)
    if value < minimum:
        raise RequestError(name, f"got {value}; allowed: {allowed}")
    return value


def _float(get: GetInput, name: str, default: float, ok: Callable[[float], bool], allowed: str) -> float:
    value = _scalar(get, name)
    if value is None:
        return default
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise RequestError(name, f"got {value}; allowed: {allowed}")
    return value


def _bool(get: GetInput, name: str, default: bool) -> bool:
    value = _scalar(get, name)
    return default if value is None else bool(value)


def parse_generate_request(get: GetInput, vocab_size: int | None = None) -> GenerateRequest:
    """Read and validate a request's inputs; ``get(name)`` returns the array or ``None``.

    Raises :class:`RequestError` naming the first bad field.
    """
    raw = get("text_input")
    if raw is None:
        raise RequestError("text_input", "is required (a non-empty string)")
    prompt = _text(_scalar(get, "text_input"), "text_input")
    if not prompt:
        raise RequestError("text_input", "is empty; allowed: a non-empty string")

    top_p = _float(get, "top_p", 1.0, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1] (0 or 1 = no nucleus filter)")
    seed = _scalar(get, "seed")
    if seed is None:
        seed = _scalar(get, "random_seed")

    stop_words: list[str] = []
    words = get("stop_words")
    if words is not None:
        for w in np.asarray(words).reshape(-1):
            text = _text(w, "stop_words")
            if text:  # TensorRT-LLM pads ragged lists with empty strings
                stop_words.append(text)

    end_id = _int(get, "end_id", None, 0, "a token id >= 0")
    if end_id is not None and vocab_size is not None and end_id >= vocab_size:
        raise RequestError("end_id", f"got {end_id}; allowed: a token id in [0, {vocab_size - 1}]")

    return GenerateRequest(
        prompt=prompt,
        max_tokens=_int(get, "max_tokens", 16, 1, "an integer >= 1"),
        stream=_bool(get, "stream", False),
        temperature=_float(get, "temperature", 1.0, lambda v: v >= 0.0, "a number >= 0 (0 = greedy)"),
        top_p=1.0 if top_p == 0.0 else top_p,
        top_k=_int(get, "top_k", 0, 0, "an integer >= 0 (0 = no top-k filter)"),
        seed=None if seed is None else int(seed),
        stop_words=stop_words,
        end_id=end_id,
        exclude_input_in_output=_bool(get, "exclude_input_in_output", False),
    )


def output_arrays(text: str, finish_reason: str | None, num_input_tokens: int,
                  num_output_tokens: int) -> dict[str, np.ndarray]:
    """One response's output tensors, each with a batch dimension of 1."""
    return {
        "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
        "finish_reason": np.array([[(finish_reason or "").encode("utf-8")]], dtype=np.object_),
        "num_input_tokens": np.array([[num_input_tokens]], dtype=np.uint32),
        "num_output_tokens": np.array([[num_output_tokens]], dtype=np.uint32),
    }
