"""The prefix cache's and ``return_perf_metrics``' response tensors, without Triton.

``num_cached_tokens`` (the prompt tokens the prefix cache served; OpenAI's
``usage.prompt_tokens_details.cached_tokens``) is on every response. The others are
TensorRT-LLM's outputs behind its ``return_perf_metrics`` input, with its names, types
and shapes (``[1, 1]``), as its clients read them; without ``return_perf_metrics`` they
are zero (Triton's ensemble needs every declared output on every response).

>>> a = perf_arrays(7, RequestPerf(reused_pages=2, first_token_ns=5, draft_tokens=4, accepted_draft_tokens=1))
>>> int(a["kv_cache_reused_blocks"][0, 0]), a["first_token_time_ns"].dtype, float(a["acceptance_rate"][0, 0])
(2, dtype('int64'), 0.25)
>>> perf_from(a.get) == (7, RequestPerf(reused_pages=2, first_token_ns=5, draft_tokens=4, accepted_draft_tokens=1))
True
"""
from __future__ import annotations

import numpy as np

from ..engine.request_perf import RequestPerf

# name -> (Triton type, numpy type, RequestPerf field); dims [1] without the batch dimension
PERF_OUTPUTS = {
    "num_cached_tokens": ("TYPE_UINT32", np.uint32, None),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", np.int32, "new_pages"),
    "kv_cache_reused_blocks": ("TYPE_INT32", np.int32, "reused_pages"),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", np.int32, "total_pages"),
    "arrival_time_ns": ("TYPE_INT64", np.int64, "arrival_ns"),
    "first_scheduled_time_ns": ("TYPE_INT64", np.int64, "first_scheduled_ns"),
    "first_token_time_ns": ("TYPE_INT64", np.int64, "first_token_ns"),
    "last_token_time_ns": ("TYPE_INT64", np.int64, "last_token_ns"),
    "acceptance_rate": ("TYPE_FP32", np.float32, "acceptance_rate"),
    "total_accepted_draft_tokens": ("TYPE_INT32", np.int32, "accepted_draft_tokens"),
    "total_draft_tokens": ("TYPE_INT32", np.int32, "draft_tokens"),
}
PERF_OUTPUT_NAMES = tuple(PERF_OUTPUTS)
_FIELDS = [f for _, _, f in PERF_OUTPUTS.values() if f not in (None, "acceptance_rate")]


def perf_arrays(num_cached_tokens: int, perf: RequestPerf | None) -> dict[str, np.ndarray]:
    """The tensors of one response (``perf`` None: zeros)."""
    perf = perf or RequestPerf()
    out = {}
    for name, (_, dtype, attr) in PERF_OUTPUTS.items():
        value = num_cached_tokens if attr is None else getattr(perf, attr)
        out[name] = np.array([[value]], dtype=dtype)
    return out


def perf_from(get) -> tuple[int, RequestPerf | None]:
    """``(num_cached_tokens, perf)`` read back from an engine reply's tensors (absent: 0, None)."""
    def value(name):
        arr = get(name)
        return None if arr is None else np.asarray(arr).reshape(-1)[0].item()
    cached = value("num_cached_tokens") or 0
    values = {f: value(n) for n, (_, _, f) in PERF_OUTPUTS.items() if f in _FIELDS}
    if all(v is None for v in values.values()):
        return int(cached), None
    return int(cached), RequestPerf(**{f: int(v or 0) for f, v in values.items()})
