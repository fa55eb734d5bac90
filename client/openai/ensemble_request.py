"""An OpenAI request as the text ensemble's input tensors, and the ensemble's errors as
OpenAI's — without Triton (numpy arrays in, so the mapping is tested without a server).

The ensemble has the TensorRT-LLM backend's interface (``backends/triton/generate_request.py``).
Each of the request's ``n`` choices is its own ensemble request; a ``seed`` becomes
``seed + index`` for choice ``index``, so the choices differ and each is reproducible.
An OpenAI field is sent only when it asks for something: a field at its neutral value
(a penalty of 0) is left out, and a field the ensemble does not declare is refused with
a 400 that names it (Triton would refuse the undeclared input anyway, less clearly).

>>> from tandem.client.openai.protocol import CompletionRequest
>>> req = CompletionRequest(model="tandem", prompt="x", max_tokens=4, temperature=0, seed=7, n=2)
>>> arrays = ensemble_inputs(req, "x", DEFAULT_DECLARED, index=1, max_tokens=4)
>>> arrays["seed"].tolist(), arrays["max_tokens"].tolist(), arrays["stream"].tolist()
([[8]], [[4]], [[False]])
>>> e = upstream_error("in ensemble 'tandem', max_tokens: got 0; allowed: an integer >= 1")
>>> e.status, e.param
(400, 'max_tokens')
>>> upstream_error("the decode KV pool is full (...); retry later").status
503
"""
from __future__ import annotations

import re

import numpy as np

from .protocol import OpenAIError, _Request, invalid

# what the ensemble declares today (the others are used when its config declares them)
DEFAULT_DECLARED = frozenset({"text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed",
                              "random_seed", "stop_words", "end_id", "exclude_input_in_output"})
# OpenAI field -> (ensemble inputs to try, in order; numpy type; the value that asks for nothing)
OPTIONAL_FIELDS = {
    "top_k": (("top_k",), np.int32, 0),
    "presence_penalty": (("presence_penalty",), np.float32, 0.0),
    "frequency_penalty": (("frequency_penalty",), np.float32, 0.0),
    "repetition_penalty": (("repetition_penalty",), np.float32, 1.0),
    "min_tokens": (("min_tokens", "min_length"), np.int32, 0),
    "ignore_eos": (("ignore_eos",), np.bool_, False),
}
LOG_PROBS_INPUT, LOG_PROBS_OUTPUT = "return_log_probs", "output_log_probs"
TOP_INPUT, PROMPT_INPUT = "num_top_log_probs", "num_prompt_log_probs"
BIAS_INPUTS = ("logit_bias_token_ids", "logit_bias_values")
LORA_INPUT = "lora_name"
CACHE_SALT_INPUT, CACHED_OUTPUT = "cache_salt", "num_cached_tokens"
SEED_MOD = 2 ** 64
# the field an ensemble error names ("in ensemble 'tandem', max_tokens: got 0; ..."), as OpenAI names it
_FIELD = re.compile(r"^(?:in ensemble '[^']*', )?([a-z_]+): ")
OPENAI_NAMES = {"text_input": "prompt", "stop_words": "stop", "random_seed": "seed", "min_length": "min_tokens",
                "return_log_probs": "logprobs", "guided_decoding_guide": "response_format",
                "num_top_log_probs": "logprobs", "num_prompt_log_probs": "prompt_logprobs",
                "logit_bias_token_ids": "logit_bias", "logit_bias_values": "logit_bias",
                "guided_decoding_guide_type": "response_format"}
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")


def one(value, dtype) -> np.ndarray:
    """A ``[1, 1]`` tensor: every ensemble input has the batch dimension."""
    return np.array([[value]], dtype=dtype)


def ensemble_inputs(req: _Request, prompt: str | list[int], declared: frozenset[str] | set[str], *, index: int,
                    max_tokens: int, stream: bool = False, logprobs: bool = False,
                    model: str = "tandem", lora_name: str | None = None) -> dict[str, np.ndarray]:
    """The input tensors of choice ``index`` of ``req`` for ``prompt`` (text, or token ids
    for a tokens ensemble's ``input_ids``); raises :class:`OpenAIError` (400) for a field
    the ensemble (inputs ``declared``) cannot take."""
    arrays = {"max_tokens": one(max_tokens, np.int32), "stream": one(stream, np.bool_)}
    if isinstance(prompt, str):
        arrays["text_input"] = one(prompt.encode("utf-8"), np.object_)
    else:
        arrays["input_ids"] = np.array([prompt], dtype=np.int32)
    if "exclude_input_in_output" in declared and isinstance(prompt, str):
        arrays["exclude_input_in_output"] = one(True, np.bool_)   # echo is done here
    if req.temperature is not None:
        arrays["temperature"] = one(req.temperature, np.float32)
    if req.top_p is not None:
        arrays["top_p"] = one(req.top_p, np.float32)
    if req.seed is not None:
        arrays["seed"] = one((req.seed + index) % SEED_MOD, np.uint64)
    stop = req.stop_words()
    if stop:
        arrays["stop_words"] = np.array([[w.encode("utf-8") for w in stop]], dtype=np.object_)
    for field, (names, dtype, neutral) in OPTIONAL_FIELDS.items():
        value = getattr(req, field)
        if value is None or value == neutral:
            continue
        name = next((n for n in names if n in declared), None)
        if name is None:
            raise invalid(field, f"not supported by this server: ensemble {model!r} declares no input "
                                 f"{' or '.join(repr(n) for n in names)}")
        arrays[name] = one(value, dtype)
    if req.cache_salt is not None:
        if CACHE_SALT_INPUT not in declared:
            raise invalid("cache_salt", f"not supported by this server: ensemble {model!r} declares no "
                                        f"input {CACHE_SALT_INPUT!r}")
        arrays[CACHE_SALT_INPUT] = one(req.cache_salt.encode("utf-8"), np.object_)
    guide = req.guide()
    if guide is not None:
        kind, text, field = guide
        if not set(GUIDE_INPUTS) <= set(declared):
            raise invalid(field, f"not supported by this server: ensemble {model!r} declares no input "
                                 f"{GUIDE_INPUTS[0]!r}")
        arrays[GUIDE_INPUTS[0]] = one(kind.encode(), np.object_)
        arrays[GUIDE_INPUTS[1]] = one(text.encode("utf-8"), np.object_)
    def require(name: str, field: str) -> None:
        if name not in declared:
            raise invalid(field, f"not supported by this server: ensemble {model!r} declares no input {name!r}")

    if logprobs:
        require(LOG_PROBS_INPUT, "logprobs")
        arrays[LOG_PROBS_INPUT] = one(True, np.bool_)
        if req.num_top_logprobs():
            require(TOP_INPUT, "logprobs")
            arrays[TOP_INPUT] = one(req.num_top_logprobs(), np.int32)
    if req.num_prompt_logprobs() is not None:
        require(PROMPT_INPUT, "prompt_logprobs")
        arrays[PROMPT_INPUT] = one(req.num_prompt_logprobs(), np.int32)
    if lora_name is not None:
        if LORA_INPUT not in declared:
            raise invalid("model", f"{lora_name!r} is a LoRA adapter, but ensemble {model!r} declares no input "
                                   f"{LORA_INPUT!r}")
        arrays[LORA_INPUT] = one(lora_name.encode("utf-8"), np.object_)
    bias = req.token_bias()
    if bias:
        require(BIAS_INPUTS[0], "logit_bias")
        arrays[BIAS_INPUTS[0]] = np.array([list(bias)], dtype=np.int32)
        arrays[BIAS_INPUTS[1]] = np.array([list(bias.values())], dtype=np.float32)
    unknown = set(arrays) - set(declared)
    if unknown:   # a required one missing from the config: say so rather than let Triton refuse it
        raise OpenAIError(500, f"ensemble {model!r} does not declare the inputs {sorted(unknown)}",
                          code="ensemble_interface")
    return arrays


def upstream_error(message: str) -> OpenAIError:
    """An error the ensemble streamed back, as an OpenAI error.

    A gRPC stream error carries Triton's message and no status code, so the status is
    read off the message Tandem's models write: their ``UNAVAILABLE`` errors say
    "unavailable" or "retry" (503), their ``INTERNAL`` ones start with "internal error"
    (500); every other error is about the request (``INVALID_ARG``: 400).
    """
    low = message.lower()
    if "unavailable" in low or "retry" in low or "no available versions" in low or "not ready" in low:
        return OpenAIError(503, message, code="unavailable")
    if low.startswith("internal error") or "internal error:" in low:
        return OpenAIError(500, message, code="internal_error")
    field = _FIELD.match(message)
    param = OPENAI_NAMES.get(field.group(1), field.group(1)) if field else None
    return OpenAIError(400, message, param=param, code="invalid_value")
