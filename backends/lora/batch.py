"""One step's LoRA plan: which rows use which adapter slot, grouped once (FlashInfer's
plan/run split: :func:`plan_lora` per step, :meth:`LoRABatch.apply` per layer).

The model's fused linear layers call ``lora.apply(layer, group, x, y)`` after their base
matmul; a step where no row uses an adapter has no plan (None) and the model does no
LoRA work at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops import Segment, lora_delta_segmented, lora_segments
from .pool import LoRAPool


@dataclass(slots=True)
class LoRABatch:
    pool: LoRAPool
    segments: list[Segment]     # (slot, rows) of each adapter present

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``group`` at ``layer`` for inputs ``x``) plus each
        row's adapter delta, in place."""
        segments = [s for s in self.segments if group in self.pool.groups(s[0])]
        if segments:
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
    device = pool.A["qkv"][0].device
    return LoRABatch(pool, [(s, r if isinstance(r, slice) else r.to(device))
                            for s, r in lora_segments(rows)])
