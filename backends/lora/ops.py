"""The batched LoRA delta, as pure functions: each row (token) of a batch has an adapter
slot, and ``y = base(x) + scale[slot] * (x @ A[slot]) @ B[slot]``; slot 0 is "no adapter"
(its A and B are zero, and no work is spent on its rows).

``A`` is ``[slots, in, rank]`` and ``B`` ``[slots, rank, out]``: every adapter padded to
the pool's maximum rank with zeros (a padded column of A meets a zero row of B, so it
adds nothing). Two ways to compute it:

- :func:`lora_delta_gathered`: every row gathers its own A and B and one ``bmm`` pair
  runs over all rows (punica's BGMV shape; no grouping, but it reads ``rows x in x rank``
  gathered weights).
- :func:`lora_delta_segmented`: rows grouped by slot (:func:`lora_segments`, once per
  step), one matmul pair per adapter present (punica's SGMV shape; the rows of a
  sequence are contiguous, so a group is usually one slice).

Measured here (``python -m tandem.backends.lora.bench [--dtype bfloat16]``: one thread
of a 2-core AMD EPYC with AVX512-BF16, cores shared with other work; in=576, out=1536,
rank 16; the 16 decode rows mix 4 adapters and the base; µs per call, median of 50):

=================  ==============  ===============  ==============  ===============
batch              fp32 gathered   fp32 segmented   bf16 gathered   bf16 segmented
=================  ==============  ===============  ==============  ===============
decode, 1 row                  34               12              62               46
decode, 16 rows               360               87             310              220
prefill, 256 rows    6700 - 11000              270     4200 - 8200              210
=================  ==============  ===============  ==============  ===============

so the engine uses the segmented one; the gathered one stays as the reference shape
of a fused GPU kernel (and for tests).

>>> import torch
>>> A, B = torch.zeros(2, 4, 2), torch.zeros(2, 2, 3)
>>> A[1], B[1] = torch.ones(4, 2), torch.ones(2, 3)
>>> x, slots = torch.ones(3, 4), torch.tensor([1, 0, 1])
>>> lora_delta_segmented(x, A, B, lora_segments(slots.tolist()))[:, 0].tolist()
[8.0, 0.0, 8.0]
"""
from __future__ import annotations

import torch

# (slot, rows): a slice when the slot's rows are contiguous, else an index tensor
Segment = tuple[int, "slice | torch.Tensor"]


def lora_delta_reference(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                         scales: torch.Tensor | None = None) -> torch.Tensor:
    """Row by row: the definition the batched versions are tested against."""
    out = x.new_zeros(x.shape[0], B.shape[-1])
    for i, s in enumerate(slots.tolist()):
        if s:
            delta = (x[i] @ A[s]) @ B[s]
            out[i] = delta * (1.0 if scales is None else scales[s])
    return out


def lora_delta_gathered(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                        scales: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, out]``: per row its slot's A and B gathered, one bmm pair over all rows
    (slot 0 rows gather zeros)."""
    xa = torch.bmm(x.unsqueeze(1), A[slots]).squeeze(1)              # [N, rank]
    if scales is not None:
        xa = xa * scales[slots].unsqueeze(1).to(xa.dtype)
    return torch.bmm(xa.unsqueeze(1), B[slots]).squeeze(1)            # [N, out]


def lora_segments(slots: list[int]) -> list[Segment]:
    """The rows of each adapter slot present (slot 0 left out), for
    :func:`lora_delta_segmented`: computed once per step, used by every layer.

    >>> lora_segments([0, 2, 2, 1, 2])
    [(2, tensor([1, 2, 4])), (1, slice(3, 4, None))]
    """
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        if s:
            rows.setdefault(s, []).append(i)
    return [(s, slice(r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r) else torch.tensor(r))
            for s, r in rows.items()]


def lora_delta_segmented(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         segments: list[Segment], scales: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, out]``: one ``(x @ A[s]) @ B[s]`` per adapter slot present, over its rows;
    added into ``out`` when given (the base output, so no zero delta is materialised)."""
    if out is None:
        out = x.new_zeros(x.shape[0], B.shape[-1])
    for s, rows in segments:
        delta = (x[rows] @ A[s]) @ B[s]
        if scales is not None:
            delta = delta * scales[s]
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows.to(out.device), delta)
    return out
