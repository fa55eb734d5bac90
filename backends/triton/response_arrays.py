"""Response tensors of Tandem's Triton models, without Triton.

Two sets, shaped as TensorRT-LLM shapes its own:

- an engine model's reply (``llm``, ``decode``; what postprocess reads):
  :func:`engine_arrays`, every tensor with the batch dimension (``[1, ...]``), as its
  ``tensorrt_llm`` model answers;
- an ensemble's response (``postprocess``'s outputs): :func:`ensemble_arrays`, with
  ``text_output`` one string per row, shape ``[1]``, as TensorRT-LLM's postprocessing
  returns it, so its clients' ``result.as_numpy("text_output")[0].decode()`` is the text.

==================  ======  ===============  ===============================================
output              type    ensemble shape   what
==================  ======  ===============  ===============================================
text_output         STRING  [1]              this response's text (engine reply: [1, 1])
finish_reason       STRING  [1, 1]           "" until the sequence's last response, then
                                             ``stop``, ``length`` or ``abort``
num_input_tokens    UINT32  [1, 1]           the prompt's tokens
num_output_tokens   UINT32  [1, 1]           the sequence's tokens so far
cum_log_probs       FP32    [1, 1]           with ``return_log_probs``: the sequence's
                                             log-probability so far, else 0
output_log_probs    FP32    [1, 1, n]        with ``return_log_probs``: this response's
                                             tokens' log-probabilities, else empty
context_logits      FP32    [1, 0, 0]        always empty (not supported)
generation_logits   FP32    [1, 1, 0, 0]     always empty (not supported)
batch_index         INT32   [1, 1]           always 0 (one request per batch)
sequence_index      INT32   [1, 1]           which of ``num_return_sequences``
output_ids          INT32   [1, n]           this response's new tokens (``tandem_tokens``,
                                             ``llm``, ``decode``)
num_cached_tokens   UINT32  [1, 1]           prompt tokens the prefix cache served
kv_cache_*, ...     [1, 1]                   with ``return_perf_metrics``: TensorRT-LLM's
                                             perf outputs (:mod:`.perf_outputs`), else 0
==================  ======  ===============  ===============================================

Every declared output is on every response: Triton's ensemble builds a streamed
response only when every requested output has a tensor, and perf_analyzer and
genai-perf request them all.

>>> r = SequenceReply([7, 8], " ab", "length", 3, 2, sequence_index=1)
>>> a = ensemble_arrays(r)
>>> a["text_output"][0].decode(), a["text_output"].shape, int(a["sequence_index"][0, 0])
(' ab', (1,), 1)
>>> engine_arrays(r)["text_output"].shape, engine_arrays(r)["output_log_probs"].shape
((1, 1), (1, 1, 0))
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..engine.request_perf import RequestPerf
from .perf_outputs import PERF_OUTPUT_NAMES, perf_arrays

ENGINE_OUTPUT_NAMES = ("output_ids", "text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
                       "cum_log_probs", "output_log_probs", "sequence_index", *PERF_OUTPUT_NAMES)
OUTPUT_NAMES = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "cum_log_probs",
                "output_log_probs", "context_logits", "generation_logits", "batch_index", "sequence_index",
                *PERF_OUTPUT_NAMES)
TOKEN_OUTPUT_NAMES = ("output_ids", *OUTPUT_NAMES)


@dataclass(slots=True)
class SequenceReply:
    """One response of one sequence."""
    token_ids: list[int]
    text: str
    finish_reason: str | None          # None until the sequence's last response
    num_input_tokens: int
    num_output_tokens: int
    sequence_index: int = 0
    log_probs: list[float] = field(default_factory=list)   # empty without return_log_probs
    cum_log_prob: float = 0.0
    num_cached_tokens: int = 0         # prompt tokens the prefix cache served
    perf: RequestPerf | None = None    # with return_perf_metrics (perf_outputs.py)


def string_array(text: str | bytes) -> np.ndarray:
    """A STRING tensor of one value, with the batch dimension."""
    return np.array([[text if isinstance(text, bytes) else text.encode("utf-8")]], dtype=np.object_)


def engine_arrays(r: SequenceReply) -> dict[str, np.ndarray]:
    """An engine model's reply, every tensor with the batch dimension."""
    return {
        "output_ids": np.asarray(r.token_ids, dtype=np.int32).reshape(1, -1),
        "text_output": string_array(r.text),
        **_common(r),
    }


def ensemble_arrays(r: SequenceReply, with_ids: bool = False) -> dict[str, np.ndarray]:
    """An ensemble's response (``output_ids`` too with ``with_ids``)."""
    out = {"text_output": np.array([r.text.encode("utf-8")], dtype=np.object_), **_common(r),
           "context_logits": np.zeros((1, 0, 0), dtype=np.float32),
           "generation_logits": np.zeros((1, 1, 0, 0), dtype=np.float32),
           "batch_index": np.zeros((1, 1), dtype=np.int32)}
    if with_ids:
        out["output_ids"] = np.asarray(r.token_ids, dtype=np.int32).reshape(1, -1)
    return out


def _common(r: SequenceReply) -> dict[str, np.ndarray]:
    return {
        "finish_reason": string_array(r.finish_reason or ""),
        "num_input_tokens": np.array([[r.num_input_tokens]], dtype=np.uint32),
        "num_output_tokens": np.array([[r.num_output_tokens]], dtype=np.uint32),
        "cum_log_probs": np.array([[r.cum_log_prob]], dtype=np.float32),
        "output_log_probs": np.asarray(r.log_probs, dtype=np.float32).reshape(1, 1, -1),
        "sequence_index": np.array([[r.sequence_index]], dtype=np.int32),
        **perf_arrays(r.num_cached_tokens, r.perf),
    }
