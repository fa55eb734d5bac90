"""Turns a batch plan into one forward pass over the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                         append_paged_kv_cache)
from ..kv_cache import KVPagePool, PageTable, build_page_table
from ..models import LlamaForCausalLM
from .scheduler import ScheduledSeq


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor       # [N] flattened new tokens of the batch
    positions: torch.Tensor       # [N]
    qo_indptr: torch.Tensor       # [B + 1] int32
    batch_indices: torch.Tensor   # [N] int32: which request each new token belongs to
    page_table: PageTable
    is_decode: bool               # every request has qo_len == 1
    sample_rows: torch.Tensor     # rows of the last token of each sequence that samples


def prepare_inputs(batch: list[ScheduledSeq], page_size: int, device) -> StepInputs:
    ids, positions, batch_idx, qo_indptr, sample_rows = [], [], [], [0], []
    for b, s in enumerate(batch):
        ids.extend(s.seq.token_ids(s.start, s.end))
        positions.extend(range(s.start, s.end))
        batch_idx.extend([b] * s.num_new_tokens)
        qo_indptr.append(len(ids))
        if s.samples:
            sample_rows.append(len(ids) - 1)
    as_tensor = lambda x, dt: torch.tensor(x, dtype=dt, device=device)
    return StepInputs(
        input_ids=as_tensor(ids, torch.long),
        positions=as_tensor(positions, torch.long),
        qo_indptr=as_tensor(qo_indptr, torch.int32),
        batch_indices=as_tensor(batch_idx, torch.int32),
        page_table=build_page_table([s.seq.pages for s in batch], [s.end for s in batch],
                                    page_size, device),
        is_decode=all(s.num_new_tokens == 1 for s in batch),
        sample_rows=as_tensor(sample_rows, torch.long),
    )


class PagedAttention:
    """The model's attention backend for one step: append the step's K/V into the
    pages, then attend with the planned wrapper. ``on_layer_done`` (optional) is told
    after each layer, which is where a KV messenger learns a layer's pages are final."""

    def __init__(self, pool: KVPagePool, wrapper, inputs: StepInputs, on_layer_done=None):
        self.pool, self.wrapper, self.inputs = pool, wrapper, inputs
        self.on_layer_done = on_layer_done

    def forward(self, layer, q, k, v):
        cache, t = self.pool.layer(layer), self.inputs.page_table
        append_paged_kv_cache(k, v, self.inputs.batch_indices, self.inputs.positions, cache,
                              t.kv_indices, t.kv_indptr, t.kv_last_page_len,
                              kv_layout=self.pool.kv_layout)
        out = self.wrapper.run(q, cache)
        if self.on_layer_done is not None:
            self.on_layer_done(layer)
        return out


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPagePool):
        self.model, self.pool = model, pool
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        # FlashInfer wants a 128 MiB scratch buffer on GPU; the torch path ignores it
        nbytes = 128 << 20 if self.device.type == "cuda" else 8
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, pool.kv_layout)
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, pool.kv_layout)

    def plan(self, inputs: StepInputs):
        cfg, t = self.model.config, inputs.page_table
        common = dict(num_qo_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                      page_size=self.pool.page_size, q_data_type=self.dtype,
                      kv_data_type=self.pool.kv.dtype)
        if inputs.is_decode:
            self.decode_wrapper.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len,
                                     head_dim=cfg.head_dim, **common)
            return self.decode_wrapper
        self.prefill_wrapper.plan(inputs.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len,
                                  head_dim_qk=cfg.head_dim, causal=True, **common)
        return self.prefill_wrapper

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq], on_layer_done=None) -> torch.Tensor:
        """fp32 logits [num sampling sequences, vocab] for the sequences that sample."""
        inputs = prepare_inputs(batch, self.pool.page_size, self.device)
        attn = PagedAttention(self.pool, self.plan(inputs), inputs, on_layer_done)
        hidden = self.model(inputs.input_ids, inputs.positions, attn)
        return self.model.compute_logits(hidden[inputs.sample_rows])
