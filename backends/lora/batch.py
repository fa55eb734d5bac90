"""One step's LoRA plan: which rows use which adapter slot, grouped once (FlashInfer's
plan/run split: :func:`plan_lora` per step, :meth:`LoRABatch.apply` per layer).

The model's fused linear layers call ``lora.apply(layer, group, x, y)`` after their base
matmul; a step where no row uses an adapter has no plan (None) and the model does no
LoRA work at all. On a CPU with the project's kernels (backends/cpu_kernels) a step of up
to :data:`KERNEL_MAX_ROWS` rows (decode, verification) computes each layer's deltas in
one call; longer steps (a prefill chunk) keep the segmented matmuls, whose per-adapter
ops are few next to their arithmetic there and which oneDNN computes faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import cpu_kernels
from .ops import Segments, lora_delta_segmented, lora_segments
from .pool import GROUPS, LoRAPool

# rows of a step up to which the fused CPU kernel runs: at in 576, out 1536, rank 16
# (python -m tandem.client.bench.lora_ops, ops.py) it took 0.3x the segmented time at 16
# rows (0.12x with bf16 activations) and 1.5-1.9x at 256
KERNEL_MAX_ROWS = 64
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
    if len(rows) <= KERNEL_MAX_ROWS and fused_kernel(pool):
        batch.row_slots = torch.tensor(rows, dtype=torch.int32)
        present = {slot for slot, _ in segments.groups}
        batch.widths = {group: torch.tensor([pool.width(s, group) if s in present and group in pool.groups(s)
                                             else 0 for s in range(pool.max_loras + 1)], dtype=torch.int32)
                        for group in GROUPS}
    return batch


def fused_kernel(pool: LoRAPool) -> bool:
    """Whether ``pool``'s deltas can run in the fused CPU kernel: fp32 weights on a CPU
    where the kernels built (``TANDEM_CPU_KERNELS`` may turn it off)."""
    return pool.device.type == "cpu" and pool.dtype == torch.float32 and cpu_kernels.load("lora")
