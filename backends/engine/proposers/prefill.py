"""The proposer's KV on the prefill side of disaggregated speculation."""
from __future__ import annotations

import torch

from ...kv_cache import KVPagePool
from ...models import LlamaForCausalLM
from ...models.mtp import MTPHead
from ..model_runner import ForwardBatch, ModelRunner


class ProposerPrefill:
    """The prefill side of disaggregated speculation: fills the proposer's KV for the
    chunk the target just computed, so that the decoder can speculate from its first
    step without running a prefill of its own (the KV travels with the target's)."""

    def __init__(self, model: LlamaForCausalLM | MTPHead, target: LlamaForCausalLM,
                 pool: KVPagePool):
        self.model, self.target = model, target
        self.runner = ModelRunner(model, pool)

    @property
    def pool(self) -> KVPagePool:
        return self.runner.pool

    @property
    def reads_next_token(self) -> bool:
        """The MTP head's row i reads t_{i+1}: its chunks need the tokens one ahead."""
        return isinstance(self.model, MTPHead)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, next_ids: list[list[int]] | None, target_hidden: torch.Tensor,
            on_layer_done=None) -> None:
        """``batch``: the target's chunks; ``next_ids``: each chunk's tokens shifted left by
        one (the MTP head's row i reads t_{i+1}); ``target_hidden``: the target's pre-norm
        hidden rows of ``batch``."""
        if isinstance(self.model, MTPHead):
            shifted = ForwardBatch(next_ids, batch.starts, batch.page_lists)
            inputs, attn = self.runner.attention(shifted, on_layer_done)
            self.model(self.target, inputs.input_ids, target_hidden, inputs.positions, attn)
        else:
            self.runner.forward(batch, on_layer_done)
