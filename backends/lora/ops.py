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
  step), one matmul pair per adapter present (punica's SGMV shape): the adapter rows are
  gathered once into slot order and the deltas scattered back once (no copy at all when
  they are in order already, as one sequence's prefill is).

Measured here (``python -m tandem.client.bench.lora_ops [--dtype bfloat16]``: one thread
of a 2-core AMD EPYC with AVX512-BF16; in=576, out=1536, rank 16; the 16 decode rows mix
4 adapters and the base; µs per call, median of 50; the fused kernel is
backends/cpu_kernels/lora_sgmv.cpp, which always holds the adapters in fp32):

=================  ==============  ===============  ==============  ===============  =======
batch              fp32 gathered   fp32 segmented   bf16 gathered   bf16 segmented   kernel
=================  ==============  ===============  ==============  ===============  =======
decode, 1 row                  34               18              62               56        7
decode, 16 rows               358               97             310              230       28
prefill, 256 rows            7095              276            4276              222      422
=================  ==============  ===============  ==============  ===============  =======

The kernel's 256-row figure is one thread on this dense layout; with the engine's two
threads and the pool's fused groups (whose zero blocks the kernel skips) it was as fast
as the segmented deltas or faster from 16 to 2,048 rows, so the engine runs it at every
step on a CPU (lora/batch.py); the gathered one stays as the reference shape of a fused GPU kernel
(and for tests).

>>> import torch
>>> A, B = torch.zeros(2, 4, 2), torch.zeros(2, 2, 3)
>>> A[1], B[1] = torch.ones(4, 2), torch.ones(2, 3)
>>> x, slots = torch.ones(3, 4), torch.tensor([1, 0, 1])
>>> lora_delta_segmented(x, A, B, lora_segments(slots.tolist()))[:, 0].tolist()
[8.0, 0.0, 8.0]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


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


@dataclass(slots=True)
class Segments:
    """A step's adapter rows grouped by slot, for :func:`lora_delta_segmented`: ``rows``
    picks them out of the batch in slot order (a slice when they are contiguous and in
    order already, e.g. one sequence's prefill), ``groups`` gives each slot's range of
    them. Computed once per step, used by every layer."""
    rows: slice | torch.Tensor
    groups: list[tuple[int, slice]]
    num_rows: int
    # the rank columns each slot's adapter fills (None: all of them); a rank-8 adapter in
    # a pool of max rank 16 computes over 8
    widths: dict[int, int] | None = None

    def only(self, keep: Callable[[int], bool], widths: dict[int, int] | None = None) -> "Segments":
        """The same rows, with the groups of the slots ``keep`` rejects left out (and
        ``widths`` for the rest)."""
        return Segments(self.rows, [g for g in self.groups if keep(g[0])], self.num_rows, widths)


def lora_segments(slots: list[int], device: torch.device | str = "cpu") -> Segments | None:
    """Group the rows of each adapter slot present (slot 0 left out); None: no adapter row.

    >>> seg = lora_segments([0, 2, 2, 1, 2])
    >>> seg.rows.tolist(), seg.groups
    ([3, 1, 2, 4], [(1, slice(0, 1, None)), (2, slice(1, 4, None))])
    >>> lora_segments([0, 1, 1, 2]).rows
    slice(1, 4, None)
    """
    order = sorted((s, i) for i, s in enumerate(slots) if s)
    if not order:
        return None
    groups: list[tuple[int, slice]] = []
    for j, (s, _) in enumerate(order):
        if groups and groups[-1][0] == s:
            groups[-1] = (s, slice(groups[-1][1].start, j + 1))
        else:
            groups.append((s, slice(j, j + 1)))
    rows = [i for _, i in order]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return Segments(slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device),
                    groups, len(rows))


def lora_delta_segmented(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segments: Segments | None,
                         scales: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, out]``: one ``(x @ A[s]) @ B[s]`` per adapter slot present, over its rows
    (gathered once into slot order, scattered back once); added into ``out`` when given
    (the base output, so no zero delta is materialised). Computed in A's dtype (the
    pool may hold fp32 weights for a bf16 model), added in ``out``'s."""
    if out is None:
        out = x.new_zeros(x.shape[0], B.shape[-1])
    if segments is None or not segments.groups:
        return out
    xs = x[segments.rows].to(A.dtype)
    g, widths = segments.groups, segments.widths

    def one(s: int, xr: torch.Tensor) -> torch.Tensor:
        w = A.shape[-1] if widths is None else widths[s]
        d = (xr @ A[s, :, :w]) @ B[s, :w]
        return d if scales is None else d * scales[s]

    if len(g) == 1 and g[0][1] == slice(0, segments.num_rows):
        delta = one(g[0][0], xs)
    else:
        delta = xs.new_zeros(segments.num_rows, B.shape[-1])
        for s, r in g:
            delta[r] = one(s, xs[r])
    if isinstance(segments.rows, slice):
        out[segments.rows] += delta.to(out.dtype)
    else:
        out.index_add_(0, segments.rows, delta.to(out.dtype))
    return out
