"""Per-request performance figures, as TensorRT-LLM reports them behind
``return_perf_metrics`` (its ``RequestPerfMetrics``: KV cache reuse, timing, speculative
decoding). Torch-free: the Triton layer turns them into response tensors.

>>> p = RequestPerf(reused_pages=4, new_pages=1, total_pages=1, draft_tokens=6, accepted_draft_tokens=3)
>>> p.acceptance_rate
0.5
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class RequestPerf:
    reused_pages: int = 0          # pages the prefix cache served (kv_cache_reused_blocks)
    new_pages: int = 0             # pages allocated for it (kv_cache_alloc_new_blocks)
    total_pages: int = 0           # ... over its life, preemptions included (kv_cache_alloc_total_blocks)
    arrival_ns: int = 0            # wall-clock ns since the epoch, as TensorRT-LLM's
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    draft_tokens: int = 0          # drafts verified (total_draft_tokens)
    accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0
