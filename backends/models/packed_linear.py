"""bf16 linear layers on oneDNN's pre-packed weights: the CPU's faster GEMM kernel.

``F.linear`` on bf16 CPU tensors reorders the weight into oneDNN's blocked layout on
every call; packing it once at load time makes the 25 linear layers of a decode step
of the demo target ~1.8x faster (``tandem bench profile``), with bit-identical output.
The original ``weight`` parameter stays (state dicts, tied embeddings and the MTP
head's use of the target's ``lm_head`` keep working); the packed copy is read-only, so
pack only models whose weights no longer change.

At 1 to 8 rows (a decode step at batch 1 to 8) oneDNN reads the weight at about half
a core's memory bandwidth; there the C++ kernel of backends/cpu_kernels/small_m_linear.cpp
runs instead, where the CPU has AVX512-BF16: a second packed copy laid out for it,
streamed in order (float accumulation, bf16 output rounded as oneDNN rounds it).

``TANDEM_PACKED_WEIGHTS=0`` turns it off (for before/after measurements).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels

SMALL_M = 8   # at most this many rows go to the small-M kernel (measured faster up to 8)


def packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN packing applies to bf16 weights on a CPU with bf16 support."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and os.environ.get("TANDEM_PACKED_WEIGHTS", "1") != "0")


class PackedLinear(nn.Module):
    """``nn.Linear``'s parameters and output, computed from a packed copy of the weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias   # the same Parameters: ties hold
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
            self._small_m = small_m_packing(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        # under torch.compile (engine/compiled_decode.py) through an opaque op: inductor's
        # own lowering of this one wants frozen weights, which its caches cannot store
        linear = packed_linear if torch.compiler.is_compiling() else _linear
        out = linear(x.reshape(-1, shape[-1]), self._packed, self._small_m, self.bias)
        return out.view(*shape[:-1], self.out_features)


def small_m_packing(weight: torch.Tensor) -> torch.Tensor | None:
    """The small-M kernel's copy of ``weight`` [out, in], or None where the kernel does
    not run (no AVX512-BF16, no compiler, or a shape it does not take)."""
    out_features, in_features = weight.shape
    if out_features % 16 or in_features % 2 or not cpu_kernels.load("linear"):
        return None
    return torch.ops.tandem_cpu.small_m_linear_pack(weight)


def _linear(x: torch.Tensor, packed: torch.Tensor, small_m: torch.Tensor | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    if small_m is not None and 0 < x.shape[0] <= SMALL_M:   # no rows: a chunk with no logits
        return torch.ops.tandem_cpu.small_m_linear(x, small_m, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("tandem::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, small_m: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` from the packed weight [out, in] (at few rows from the
    small-M kernel's copy, when there is one), opaque to inductor."""
    return _linear(x, packed, small_m, bias)


@packed_linear.register_fake
def _(x, packed, small_m, bias):
    return x.new_empty(x.shape[0], packed.shape[0])


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 ``nn.Linear`` of ``model`` for a :class:`PackedLinear` where the
    CPU supports it; returns how many were packed (0 elsewhere, e.g. on GPU or fp32)."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) is nn.Linear and packing_supported(child.weight)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
