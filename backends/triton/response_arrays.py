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
output_top_token_ids INT32  [1, n, k]        with ``num_top_log_probs`` k: the k most likely
output_top_log_probs FP32   [1, n, k]        tokens at each of this response's positions
                                             and their log-probabilities, else [1, 0, 0]
prompt_token_ids    INT32   [1, P]           with ``num_prompt_log_probs`` k, on the
prompt_log_probs    FP32    [1, P]           sequence's first response only: the prompt's
prompt_top_token_ids INT32  [1, P, k]        tokens, their log-probabilities (NaN at 0:
prompt_top_log_probs FP32   [1, P, k]        nothing predicts the first) and the k most
                                             likely at each (-1 and NaN at 0); else
                                             empty ([1, 0], [1, 0, 0])
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

import math
from dataclasses import dataclass, field

import numpy as np

from ..engine.request_perf import RequestPerf
from .perf_outputs import PERF_OUTPUT_NAMES, perf_arrays

TOP_OUTPUT_NAMES = ("output_top_token_ids", "output_top_log_probs")
PROMPT_OUTPUT_NAMES = ("prompt_token_ids", "prompt_log_probs", "prompt_top_token_ids", "prompt_top_log_probs")
ENGINE_OUTPUT_NAMES = ("output_ids", "text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
                       "cum_log_probs", "output_log_probs", *TOP_OUTPUT_NAMES, *PROMPT_OUTPUT_NAMES,
                       "sequence_index", *PERF_OUTPUT_NAMES)
OUTPUT_NAMES = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "cum_log_probs",
                "output_log_probs", *TOP_OUTPUT_NAMES, *PROMPT_OUTPUT_NAMES, "context_logits",
                "generation_logits", "batch_index", "sequence_index", *PERF_OUTPUT_NAMES)
TOKEN_OUTPUT_NAMES = ("output_ids", *OUTPUT_NAMES)


@dataclass(slots=True)
class PromptReply:
    """A prompt's log-probabilities (engine/logprobs.py ``PromptLogprobs``, as lists):
    position 0 has none (NaN; its alternatives are empty)."""
    token_ids: list[int]
    log_probs: list[float]
    top_ids: list[list[int]]
    top_log_probs: list[list[float]]

    @classmethod
    def of(cls, lp) -> "PromptReply":
        return cls(list(lp.token_ids), [math.nan if x is None else x for x in lp.logprobs],
                   [t.token_ids for t in lp.top], [t.logprobs for t in lp.top])


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
    # with num_top_log_probs: each token's alternatives (ids, log-probabilities)
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)
    prompt: PromptReply | None = None  # with num_prompt_log_probs, on the first reply
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
        **logprob_arrays(r),
        "sequence_index": np.array([[r.sequence_index]], dtype=np.int32),
        **perf_arrays(r.num_cached_tokens, r.perf),
    }


def _ranked(ids: list[list[int]], values: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of alternatives as [1, rows, k] arrays; a shorter row (a prompt's first
    position) is padded with -1 and NaN."""
    k = max((len(row) for row in ids), default=0)
    out_ids = np.full((1, len(ids), k), -1, dtype=np.int32)
    out_values = np.full((1, len(ids), k), np.nan, dtype=np.float32)
    for i, (row, vals) in enumerate(zip(ids, values)):
        out_ids[0, i, :len(row)] = row
        out_values[0, i, :len(vals)] = vals
    return out_ids, out_values


def logprob_arrays(r: SequenceReply) -> dict[str, np.ndarray]:
    """The alternatives and the prompt's log-probabilities (empty when not asked for)."""
    top_ids, top_values = _ranked(r.top_ids, r.top_log_probs)
    p = r.prompt or PromptReply([], [], [], [])
    prompt_ids, prompt_values = _ranked(p.top_ids, p.top_log_probs)
    return {"output_top_token_ids": top_ids, "output_top_log_probs": top_values,
            "prompt_token_ids": np.asarray(p.token_ids, dtype=np.int32).reshape(1, -1),
            "prompt_log_probs": np.asarray(p.log_probs, dtype=np.float32).reshape(1, -1),
            "prompt_top_token_ids": prompt_ids, "prompt_top_log_probs": prompt_values}


def logprobs_from(get) -> tuple[list[list[int]], list[list[float]], PromptReply | None]:
    """The inverse of :func:`logprob_arrays` (absent tensors read as none)."""
    def rows(name, n=None):
        a = get(name)
        a = np.zeros((1, 0, 0)) if a is None else np.asarray(a)
        if not a.size:
            return [[] for _ in range(n or 0)]
        return a.reshape(-1, a.shape[-1]).tolist()
    top_ids, top_values = rows("output_top_token_ids"), rows("output_top_log_probs")
    ids = get("prompt_token_ids")
    ids = [] if ids is None else np.asarray(ids).reshape(-1).tolist()
    if not ids:
        return top_ids, top_values, None
    p_ids, p_values = rows("prompt_top_token_ids", len(ids)), rows("prompt_top_log_probs", len(ids))
    p_ids[0], p_values[0] = [], []    # the first position's padding goes again
    return top_ids, top_values, PromptReply(
        ids, np.asarray(get("prompt_log_probs"), dtype=np.float32).reshape(-1).tolist(), p_ids, p_values)
