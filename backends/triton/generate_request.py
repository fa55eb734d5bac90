"""Request and response tensors of Tandem's Triton models, without Triton.

The interface is the TensorRT-LLM backend's, so its clients, ``genai-perf``,
``perf_analyzer`` and Triton's HTTP ``generate``/``generate_stream`` endpoints work
unchanged. A request comes in one of two forms that share the sampling inputs:

- text: ``text_input`` (the ensembles ``tandem`` and ``tandem_colocated``, and their
  ``preprocess`` step): :func:`parse_generate_request`;
- token ids: ``input_ids`` (``llm``, ``decode``, ``kv_transfer`` and the ensemble
  ``tandem_tokens``): :func:`parse_token_request`, the one parser those models share.

Every tensor carries the batch dimension (``max_batch_size: 1``), so a client sends
``text_input`` with shape ``[1, 1]`` and ``input_ids`` with shape ``[1, n]``.

Inputs and defaults (all but ``text_input`` / ``input_ids`` optional):

==========================  ======  ===========  ==========================================
name                        type    default      allowed
==========================  ======  ===========  ==========================================
text_input                  STRING  (required)   non-empty UTF-8 text (text form)
input_ids                   INT32   (required)   non-empty token ids in the vocabulary
                                                 (token form)
max_tokens                  INT32   16           >= 1; prompt + max_tokens <= the context
stream                      BOOL    false        true: one response per engine step
temperature                 FP32    1.0          >= 0; 0 = greedy
top_p                       FP32    1.0          (0, 1]; 1 = no nucleus filter
top_k                       INT32   0            >= 0; 0 = no top-k filter
seed                        UINT64  (random)     any (``random_seed`` is accepted too)
stop_words                  STRING  none         up to 16 strings of up to 256 characters;
                                                 text stops before them
end_id                      INT32   model's EOS  a token id; replaces the EOS token
exclude_input_in_output     BOOL    false        text form only: false makes the
                                                 non-streaming text start with the
                                                 prompt (as in TensorRT-LLM); streaming
                                                 never repeats the prompt
==========================  ======  ===========  ==========================================

Outputs: ``text_output`` (STRING), ``finish_reason`` (STRING: ``""`` until the last
response, then ``stop``, ``length`` or ``abort``), ``num_input_tokens`` and
``num_output_tokens`` (UINT32, cumulative); the token-level models add
``output_ids`` (INT32 [-1]: this response's new token ids).

>>> inputs = {"text_input": np.array([[b"def f():"]], dtype=object),
...           "max_tokens": np.array([[8]], dtype=np.int32)}
>>> req = parse_generate_request(inputs.get)
>>> (req.prompt, req.max_tokens, req.stream)
('def f():', 8, False)
>>> req = parse_token_request({"input_ids": np.array([[5, 9]], dtype=np.int32)}.get,
...                           vocab_size=100, max_model_len=64)
>>> req.prompt
[5, 9]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

SAMPLING_NAMES = ("max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "random_seed",
                  "stop_words", "end_id")
INPUT_NAMES = ("text_input", *SAMPLING_NAMES, "exclude_input_in_output")
TOKEN_INPUT_NAMES = ("input_ids", *SAMPLING_NAMES)
OUTPUT_NAMES = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
TOKEN_OUTPUT_NAMES = ("output_ids", *OUTPUT_NAMES)

GetInput = Callable[[str], "np.ndarray | None"]
# each generated token is checked against every stop word on the engine thread
MAX_STOP_WORDS = 16
MAX_STOP_WORD_CHARS = 256


class RequestError(ValueError):
    """A user error in one input; the message names the field and what is allowed."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


@dataclass(slots=True)
class GenerateRequest:
    prompt: str | list[int]       # text (text form) or token ids (token form)
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


# ---- reading one field --------------------------------------------------------------
def scalar(get: GetInput, name: str):
    """The single value of input ``name``, or None when the request omits it."""
    arr = get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise RequestError(name, f"expected one value, got {flat.size} (shape {list(np.shape(arr))})")
    return flat[0]


def as_text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return str(value)


def flag(get: GetInput, name: str, default: bool) -> bool:
    value = scalar(get, name)
    return default if value is None else bool(value)


def _int(get: GetInput, name: str, default, minimum: int, allowed: str):
    value = scalar(get, name)
    if value is None:
        return default
    value = int(value)
    if value < minimum:
        raise RequestError(name, f"got {value}; allowed: {allowed}")
    return value


def _float(get: GetInput, name: str, default: float, ok: Callable[[float], bool], allowed: str) -> float:
    value = scalar(get, name)
    if value is None:
        return default
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise RequestError(name, f"got {value}; allowed: {allowed}")
    return value


# ---- the two request forms ------------------------------------------------------------
def _sampling(get: GetInput, vocab_size: int | None) -> dict:
    """The sampling inputs both forms share, validated."""
    seed = scalar(get, "seed")
    if seed is None:
        seed = scalar(get, "random_seed")

    stop_words: list[str] = []
    words = get("stop_words")
    if words is not None:
        words = np.asarray(words).reshape(-1)
        if words.size > 4 * MAX_STOP_WORDS:   # before decoding anything (padding aside)
            raise RequestError("stop_words", f"has {words.size} entries; allowed: up to {MAX_STOP_WORDS}")
        for w in words:
            text = as_text(w, "stop_words")
            if len(text) > MAX_STOP_WORD_CHARS:
                raise RequestError("stop_words", f"a stop word has {len(text)} characters; allowed: up to "
                                                 f"{MAX_STOP_WORD_CHARS}")
            if text:  # TensorRT-LLM pads ragged lists with empty strings
                stop_words.append(text)
        if len(stop_words) > MAX_STOP_WORDS:
            raise RequestError("stop_words", f"has {len(stop_words)} words; allowed: up to {MAX_STOP_WORDS}")

    end_id = _int(get, "end_id", None, 0, "a token id >= 0")
    if end_id is not None and vocab_size is not None and end_id >= vocab_size:
        raise RequestError("end_id", f"got {end_id}; allowed: a token id in [0, {vocab_size - 1}]")

    return dict(
        max_tokens=_int(get, "max_tokens", 16, 1, "an integer >= 1"),
        stream=flag(get, "stream", False),
        temperature=_float(get, "temperature", 1.0, lambda v: v >= 0.0, "a number >= 0 (0 = greedy)"),
        top_p=_float(get, "top_p", 1.0, lambda v: 0.0 < v <= 1.0, "a number in (0, 1] (1 = no nucleus filter)"),
        top_k=_int(get, "top_k", 0, 0, "an integer >= 0 (0 = no top-k filter)"),
        seed=None if seed is None else int(seed),
        stop_words=stop_words,
        end_id=end_id,
    )


def parse_generate_request(get: GetInput, vocab_size: int | None = None) -> GenerateRequest:
    """Read and validate a text request; ``get(name)`` returns the array or ``None``.

    Raises :class:`RequestError` naming the first bad field. The prompt's length is
    checked once it is tokenized (:func:`check_context`).
    """
    if get("text_input") is None:
        raise RequestError("text_input", "is required (a non-empty string)")
    prompt = as_text(scalar(get, "text_input"), "text_input")
    if not prompt:
        raise RequestError("text_input", "is empty; allowed: a non-empty string")
    return GenerateRequest(prompt=prompt, **_sampling(get, vocab_size),
                           exclude_input_in_output=flag(get, "exclude_input_in_output", False))


def parse_token_request(get: GetInput, vocab_size: int, max_model_len: int) -> GenerateRequest:
    """Read and validate a token-id request (``input_ids`` and the sampling inputs),
    including the prompt's and ``max_tokens``' fit in the context.

    Raises :class:`RequestError` naming the first bad field.
    """
    ids = _token_ids(get, vocab_size, max_model_len)
    sampling = _sampling(get, vocab_size)
    check_context(len(ids), sampling["max_tokens"], max_model_len, "input_ids")
    return GenerateRequest(prompt=ids, **sampling)


def _token_ids(get: GetInput, vocab_size: int, max_model_len: int) -> list[int]:
    arr = get("input_ids")
    if arr is None:
        raise RequestError("input_ids", "is required (a non-empty list of token ids)")
    arr = np.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise RequestError("input_ids", f"has type {arr.dtype}; allowed: INT32 token ids")
    if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise RequestError("input_ids", f"expected one sequence of shape [1, n], got shape {list(arr.shape)}")
    check_context(arr.size, 1, max_model_len, "input_ids")   # before converting a huge array
    ids = arr.reshape(-1).astype(np.int64)
    if ids.size == 0:
        raise RequestError("input_ids", "is empty; allowed: a non-empty list of token ids")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise RequestError("input_ids", f"token id {int(bad[0])} is not in the vocabulary; "
                                        f"allowed: ids in [0, {vocab_size - 1}]")
    return ids.tolist()


def check_text_length(text: str, max_model_len: int, max_token_bytes: int) -> None:
    """Refuse, without tokenizing it, a text that must be longer than the context: a
    token covers at most ``max_token_bytes`` bytes of text."""
    num_bytes = len(text.encode("utf-8"))
    if num_bytes > max_model_len * max_token_bytes:
        raise RequestError("text_input", f"has {num_bytes} bytes, more than {max_model_len} tokens of "
                                         f"this model can hold; the context is {max_model_len} tokens")


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_field: str) -> None:
    """The prompt must leave room for ``max_tokens`` new tokens in the context."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise RequestError(prompt_field, f"has {num_prompt_tokens} tokens; the context is {max_model_len} "
                                         "tokens, leaving room for at least one new token")
    if max_tokens > room:
        raise RequestError("max_tokens", f"got {max_tokens}; the prompt has {num_prompt_tokens} tokens of a "
                                         f"{max_model_len}-token context; allowed: <= {room}")


# ---- responses -------------------------------------------------------------------------
def string_array(text: str | bytes) -> np.ndarray:
    """A STRING tensor of one value, with the batch dimension."""
    return np.array([[text if isinstance(text, bytes) else text.encode("utf-8")]], dtype=np.object_)


def output_arrays(text: str, finish_reason: str | None, num_input_tokens: int,
                  num_output_tokens: int) -> dict[str, np.ndarray]:
    """One response's text outputs, each with a batch dimension of 1."""
    return {
        "text_output": string_array(text),
        "finish_reason": string_array(finish_reason or ""),
        "num_input_tokens": np.array([[num_input_tokens]], dtype=np.uint32),
        "num_output_tokens": np.array([[num_output_tokens]], dtype=np.uint32),
    }


def token_output_arrays(token_ids: Sequence[int], text: str, finish_reason: str | None,
                        num_input_tokens: int, num_output_tokens: int) -> dict[str, np.ndarray]:
    """A token-level model's response: ``output_ids`` and the text outputs."""
    return {"output_ids": np.asarray(token_ids, dtype=np.int32).reshape(1, -1),
            **output_arrays(text, finish_reason, num_input_tokens, num_output_tokens)}
