"""One forward pass of a model over a ragged batch on its paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                         append_paged_kv_cache, append_slots)
from ..kv_cache import KVPagePool, PageTable, build_page_table
from ..lora import LoRABatch, LoRAPool, plan_lora
from ..models import LlamaForCausalLM, pack_linears


@dataclass(slots=True)
class ForwardBatch:
    """The interface between the engine and a runner: each sequence's new tokens,
    the KV position of the first of them, and the pages that hold its KV; with LoRA,
    each sequence's adapter slot (0: the base model; None: no row uses an adapter)."""
    token_ids: list[list[int]]
    starts: list[int]
    page_lists: list[list[int]]
    lora_slots: list[int] | None = None

    @property
    def uses_lora(self) -> bool:
        return bool(self.lora_slots) and any(self.lora_slots)

    @property
    def qo_lens(self) -> list[int]:
        return [len(t) for t in self.token_ids]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor       # [N] flattened new tokens of the batch
    positions: torch.Tensor       # [N]
    qo_indptr: torch.Tensor       # [B + 1] int32
    batch_indices: torch.Tensor   # [N] int32: which request each new token belongs to
    page_table: PageTable
    is_decode: bool               # every request has qo_len == 1
    lora: LoRABatch | None = None  # each row's adapter slot, grouped (None: no adapter)

    @property
    def last_rows(self) -> torch.Tensor:
        """Row of each sequence's last new token."""
        return self.qo_indptr[1:].long() - 1


def prepare_inputs(batch: ForwardBatch, page_size: int, device,
                   lora_pool: LoRAPool | None = None) -> StepInputs:
    ids, positions, batch_idx, qo_indptr = [], [], [], [0]
    for b, (toks, start) in enumerate(zip(batch.token_ids, batch.starts)):
        ids.extend(toks)
        positions.extend(range(start, start + len(toks)))
        batch_idx.extend([b] * len(toks))
        qo_indptr.append(len(ids))
    as_tensor = lambda x, dt: torch.tensor(x, dtype=dt, device=device)
    ends = [s + len(t) for s, t in zip(batch.starts, batch.token_ids)]
    return StepInputs(
        input_ids=as_tensor(ids, torch.long),
        positions=as_tensor(positions, torch.long),
        qo_indptr=as_tensor(qo_indptr, torch.int32),
        batch_indices=as_tensor(batch_idx, torch.int32),
        page_table=build_page_table(batch.page_lists, ends, page_size, device),
        is_decode=all(len(t) == 1 for t in batch.token_ids),
        lora=plan_lora(lora_pool, batch.lora_slots, batch.qo_lens),
    )


class PagedAttention:
    """The model's attention backend for one step: append the step's K/V into the
    pages, then attend with the planned wrapper. ``on_layer_done`` (optional) is told
    after each layer, which is where a KV messenger learns a layer's pages are final."""

    def __init__(self, pool: KVPagePool, wrapper, inputs: StepInputs, on_layer_done=None):
        self.pool, self.wrapper, self.inputs = pool, wrapper, inputs
        self.on_layer_done = on_layer_done
        t = inputs.page_table
        # every layer appends at the same places: their index maths once per step
        self.slots = append_slots(inputs.batch_indices, inputs.positions, t.kv_indices,
                                  t.kv_indptr, pool.page_size, pool.kv_layout, pool.num_kv_heads)

    def forward(self, layer, q, k, v):
        cache, t = self.pool.layer(layer), self.inputs.page_table
        append_paged_kv_cache(k, v, self.inputs.batch_indices, self.inputs.positions, cache,
                              t.kv_indices, t.kv_indptr, t.kv_last_page_len,
                              kv_layout=self.pool.kv_layout, slots=self.slots)
        out = self.wrapper.run(q, cache)
        if self.on_layer_done is not None:
            self.on_layer_done(layer)
        return out


class ModelRunner:
    """Plans attention for a batch and runs one model (target, draft or MTP head) on it."""

    def __init__(self, model: LlamaForCausalLM | torch.nn.Module, pool: KVPagePool,
                 lora_pool: LoRAPool | None = None):
        """``model`` has a ``config`` and a ``rank_config`` (the head counts it computes:
        a tensor-parallel rank's share, else its config) and is called as a LlamaForCausalLM
        by :meth:`forward`; an MTP head uses :meth:`attention` and calls itself.
        ``lora_pool``: the adapters a batch's ``lora_slots`` index (the target's only)."""
        self.model, self.pool, self.lora_pool = model, pool, lora_pool
        pack_linears(model)   # inference only from here: oneDNN's packed bf16 weights
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type == "cpu":
            # built (or loaded) now, not in the first request's step: a build takes seconds
            from ..attention import cpu_kernel
            cpu_kernel.load()
        # FlashInfer wants a 128 MiB scratch buffer on GPU; the torch path ignores it
        nbytes = 128 << 20 if self.device.type == "cuda" else 8
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, pool.kv_layout)
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, pool.kv_layout)

    def attention(self, batch: ForwardBatch, on_layer_done=None) -> tuple[StepInputs, PagedAttention]:
        inputs = prepare_inputs(batch, self.pool.page_size, self.device, self.lora_pool)
        cfg, t = self.model.rank_config, inputs.page_table
        common = dict(num_qo_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                      page_size=self.pool.page_size, q_data_type=self.dtype,
                      kv_data_type=self.pool.kv.dtype)
        if inputs.is_decode:
            self.decode_wrapper.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len,
                                     head_dim=cfg.head_dim, **common)
            wrapper = self.decode_wrapper
        else:
            self.prefill_wrapper.plan(inputs.qo_indptr, t.kv_indptr, t.kv_indices,
                                      t.kv_last_page_len, head_dim_qk=cfg.head_dim, causal=True,
                                      **common)
            wrapper = self.prefill_wrapper
        return inputs, PagedAttention(self.pool, wrapper, inputs, on_layer_done)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, on_layer_done=None) -> tuple[StepInputs, torch.Tensor]:
        """Pre-norm hidden states [N, hidden] of every new token."""
        inputs, attn = self.attention(batch, on_layer_done)
        if inputs.lora is None:
            return inputs, self.model(inputs.input_ids, inputs.positions, attn)
        return inputs, self.model(inputs.input_ids, inputs.positions, attn, lora=inputs.lora)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
