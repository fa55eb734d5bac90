"""A decode step's roofline on the machine at hand: the bytes it must read (weights and
KV) over the measured read bandwidth, its FLOPs over the measured matmul peak; the
larger of the two is the fastest the step could run, and its share of the measured
step time says how close the engine gets."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StepWork:
    bytes: float     # weights (every matrix once; the embedding: one row per token) + KV read
    flops: float     # 2 per multiply-add: the linears and attention's two products


def decode_work(cfg, batch: int, context: int, dtype_bytes: int) -> StepWork:
    """What one decode step of ``batch`` sequences with ``context`` tokens of KV each
    reads and computes.

    >>> from types import SimpleNamespace as NS
    >>> cfg = NS(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...          num_key_value_heads=1, head_dim=2, vocab_size=10)
    >>> w = decode_work(cfg, batch=1, context=3, dtype_bytes=2)
    >>> w.bytes, w.flops   # (184 matrix + 12 norm + 4 embedding) * 2 bytes + 12 KV * 2 bytes
    (424.0, 416.0)
    """
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i
    matrices = layers * per_layer + h * cfg.vocab_size          # + lm_head
    norms = (2 * layers + 1) * h
    kv = batch * layers * 2 * context * hkv * d
    weight_bytes = (matrices + norms + batch * h) * dtype_bytes
    flops = 2 * batch * matrices + batch * layers * 4 * context * hq * d
    return StepWork(float(weight_bytes + kv * dtype_bytes), float(flops))


def roofline_ms(work: StepWork, read_gb_s: float, peak_gflops: float) -> float:
    """The step's lower bound in ms: memory or compute, whichever takes longer.

    >>> roofline_ms(StepWork(2e6, 1e6), read_gb_s=1.0, peak_gflops=1.0)
    2.0
    """
    return max(work.bytes / read_gb_s, work.flops / peak_gflops) / 1e6


def read_bandwidth_gb_s(mib: int = 256, repeats: int = 5) -> float:
    """Streaming read bandwidth with torch's threads (a sum over a buffer far larger
    than the caches), best of ``repeats``."""
    import torch
    x = torch.ones(mib << 18, dtype=torch.float32)   # mib MiB
    x.sum()
    best = min(_seconds(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def matmul_peak_gflops(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """GEMM throughput at ``n`` x ``n`` x ``n`` in ``dtype`` with torch's threads, best of
    ``repeats``."""
    import torch
    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(a.dtype)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _seconds(fn) -> float:
    """CPU seconds of ``fn`` (a shared host's other tenants do not count)."""
    start = time.process_time()
    fn()
    return time.process_time() - start
