"""One step's LoRA plan: which rows use which adapter slot, grouped once (FlashInfer's
plan/run split: :func:`plan_lora` per step, :meth:`LoRABatch.apply` per layer).

The model's fused linear layers call ``lora.apply(layer, group, x, y)`` after their base
matmul; a step where no row uses an adapter has no plan (None) and the model does no
LoRA work at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops import Segments, lora_delta_segmented, lora_segments
from .pool import GROUPS, LoRAPool


@dataclass(slots=True)
class LoRABatch:
    pool: LoRAPool
    segments: Segments          # the adapter rows, grouped by slot
    # per module group, the rows of the slots whose adapter changes it (None: no such slot)
    by_group: dict[str, Segments | None]

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``group`` at ``layer`` for inputs ``x``) plus each
        row's adapter delta, in place."""
        segments = self.by_group[group]
        if segments is not None:
            A, B = self.pool.weights(layer, group)
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
    return LoRABatch(pool, segments, by_group)
