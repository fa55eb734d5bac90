"""Gathered against segmented LoRA deltas (ops.py) at a decode step of 1 and 16 rows and a
256-token prefill: ``python -m tandem.backends.lora.bench`` prints µs per call (median of
repeats, one thread). A measurement, not a test."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .ops import lora_delta_gathered, lora_delta_segmented, lora_segments

# (name, slot of each row): 4 adapters and the base, as a mixed serving batch has them
CASES = {"decode, 1 row": [1],
         "decode, 16 rows": [i % 5 for i in range(16)],
         "prefill, 256 rows": [1] * 256}


def time_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--in-features", type=int, default=576)    # SmolLM2-135M's hidden size
    p.add_argument("--out-features", type=int, default=1536)  # ... and its MLP width
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    A = torch.randn(5, args.in_features, args.rank, dtype=dtype)
    B = torch.randn(5, args.rank, args.out_features, dtype=dtype)
    A[0] = B[0] = 0
    print(f"{'batch':<20}{'gathered µs':>14}{'segmented µs':>14}   ({args.dtype}, in {args.in_features}, "
          f"out {args.out_features}, rank {args.rank})")
    for name, slots in CASES.items():
        x = torch.randn(len(slots), args.in_features, dtype=dtype)
        y = torch.zeros(len(slots), args.out_features, dtype=dtype)
        idx = torch.tensor(slots)
        segments = lora_segments(slots)
        g = time_us(lambda: lora_delta_gathered(x, A, B, idx), args.repeats)
        s = time_us(lambda: lora_delta_segmented(x, A, B, segments, out=y), args.repeats)
        print(f"{name:<20}{g:>14.0f}{s:>14.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
