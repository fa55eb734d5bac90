"""One step's LoRA plan: which rows use which adapter slot, grouped once (FlashInfer's
plan/run split: :func:`plan_lora` per step, :meth:`LoRABatch.apply` per layer).

The model's fused linear layers call ``lora.apply(layer, group, x, y)`` after their base
matmul; a step where no row uses an adapter has no plan (None) and the model does no
LoRA work at all. On a CPU with the project's kernels (backends/cpu_kernels) each layer's
deltas are one call of the fused kernel, at every step size: on SmolLM2-135M (bf16, 2
threads, the pool's layout) it took 0.3-0.8x the segmented matmuls' time from 16 to 2,048
rows, and a 128-token prefill with an adapter went from 1.53x the base's time to 1.2x.
Elsewhere (a GPU, no compiler) the segmented matmuls run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import cpu_kernels
from .ops import Segments, lora_delta_segmented, lora_segments
from .pool import GROUPS, LoRAPool

KERNEL_DTYPES = (torch.float32, torch.bfloat16)     # of the model's activations


@dataclass(slots=True)
class LoRABatch:
    pool: LoRAPool
    segments: Segments          # the adapter rows, grouped by slot
    # per module group, the rows of the slots whose adapter changes it (None: no such slot)
    by_group: dict[str, Segments | None]
    # for the fused kernel (None: the segmented matmuls): each row's slot, int32 [rows],
    # and per group each slot's width in it (0: the slot's adapter leaves it alone)
    row_slots: torch.Tensor | None = None
    widths: dict[str, torch.Tensor] | None = None

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``group`` at ``layer`` for inputs ``x``) plus each
        row's adapter delta, in place."""
        segments = self.by_group[group]
        if segments is not None:
            A, B = self.pool.weights(layer, group)
            if self.row_slots is not None and y.is_contiguous() and x.dtype == y.dtype in KERNEL_DTYPES:
                torch.ops.tandem_cpu.lora_sgmv_(y, x, A, B, self.row_slots, self.widths[group],
                                                self.pool.part_cols[group])
            else:
                lora_delta_segmented(x, A, B, segments, out=y)
        return y


def plan_lora(pool: LoRAPool | None, seq_slots: list[int] | None,
              qo_lens: list[int]) -> LoRABatch | None:
    """The plan for a batch whose sequence ``i`` has ``qo_lens[i]`` new tokens under
    adapter slot ``seq_slots[i]`` (0: none); None when no row uses an adapter."""
    if pool is None or not seq_slots or not any(seq_slots):
        return None
    rows = [s for s, n in zip(seq_slots, qo_lens) for _ in range(n)]
    segments = lora_segments(rows, pool.device)
    by_group = {}
    for group in GROUPS:
        kept = segments.only(lambda slot: group in pool.groups(slot),
                             {slot: pool.width(slot, group) for slot, _ in segments.groups})
        by_group[group] = kept if kept.groups else None
    batch = LoRABatch(pool, segments, by_group)
    if fused_kernel(pool):
        batch.row_slots = torch.tensor(rows, dtype=torch.int32)
        batch.widths = {group: slot_widths(kept, pool.max_loras) for group, kept in by_group.items()
                        if kept is not None}
    return batch


def slot_widths(kept: Segments, max_loras: int) -> torch.Tensor:
    """int32 [max_loras + 1]: each slot's width in a group (0: no row of it changes the group)."""
    widths = [0] * (max_loras + 1)
    for slot, _ in kept.groups:
        widths[slot] = kept.widths[slot]
    return torch.tensor(widths, dtype=torch.int32)


def fused_kernel(pool: LoRAPool) -> bool:
    """Whether ``pool``'s deltas can run in the fused CPU kernel: fp32 weights on a CPU
    where the kernels built (``TANDEM_CPU_KERNELS`` may turn it off)."""
    return pool.device.type == "cpu" and pool.dtype == torch.float32 and cpu_kernels.load("lora")
