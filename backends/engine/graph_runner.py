"""Decode steps replayed from CUDA graphs: the per-layer launch overhead paid once.

A decode step (one new token per sequence) has the same shape for every batch of the
same size, so it can be captured once per *capture size* and replayed: the batch is
padded to the next capture size, its inputs copied into static buffers, FlashInfer's
``plan()`` runs outside the graph (it writes the page table into the wrapper's fixed
buffers, as FlashInfer's ``use_cuda_graph=True`` mode requires: one wrapper per batch
size) and ``replay()`` runs every layer, KV append and attention included. Padding rows
write their KV into one scratch page that no sequence owns and attend to it alone.

The capture is a :class:`GraphBackend`: CUDA graphs on a GPU; on the CPU an eager
stand-in that calls the captured function again, so the padding, static buffers and
page tables are tested on the CPU exactly as the GPU uses them (the capture itself is
GPU-only; see docs/BENCHMARKS.md for what has not run on a device yet).
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable, Protocol

import torch

from ..attention import BatchDecodeWithPagedKVCacheWrapper
from ..kv_cache import KVPagePool, PageTable, pages_needed
from .model_runner import ForwardBatch, PagedAttention, StepInputs


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, as vLLM picks them: 1, 2, 4, then every multiple of 8.

    >>> capture_sizes(20)
    [1, 2, 4, 8, 16, 24]
    >>> capture_sizes(3), capture_sizes(1)
    ([1, 2, 4], [1])
    """
    sizes = []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        sizes.append(size)
        if size >= max_num_seqs:
            return sizes
    raise AssertionError("unreachable")


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest capture size that holds ``n`` rows, or None (too many: run eagerly).

    >>> padded_size(3, [1, 2, 4, 8]), padded_size(9, [1, 2, 4, 8])
    (4, None)
    """
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def pad_decode_batch(batch: ForwardBatch, size: int, scratch_page: int) -> ForwardBatch:
    """``batch`` with ``size - len(batch)`` rows appended that write and read only
    ``scratch_page`` (token 0 at position 0).

    >>> pad_decode_batch(ForwardBatch([[7]], [20], [[3, 4]]), 3, 9).page_lists
    [[3, 4], [9], [9]]
    """
    extra = size - len(batch.token_ids)
    return ForwardBatch(batch.token_ids + [[0]] * extra, batch.starts + [0] * extra,
                        batch.page_lists + [[scratch_page]] * extra)


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Record ``fn`` (which reads and writes only static tensors); return its replay."""


class EagerGraphs:
    """The CPU stand-in: replaying runs the function again."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        fn()
        return fn


class CudaGraphs:
    """``torch.cuda.CUDAGraph`` capture after warm-up runs on a side stream; the graphs
    share one memory pool."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph.replay


class _Captured:
    """Static buffers, a FlashInfer-style decode wrapper and the replay of one size."""

    def __init__(self, runner: "GraphedDecode", size: int):
        dev, max_pages = runner.device, runner.max_pages_per_seq * size
        i32 = dict(dtype=torch.int32, device=dev)
        self.size = size
        self.input_ids = torch.zeros(size, dtype=torch.long, device=dev)
        self.positions = torch.zeros(size, dtype=torch.long, device=dev)
        self.batch_indices = torch.arange(size, **i32)
        self.qo_indptr = torch.arange(size + 1, **i32)
        self.kv_indptr = torch.zeros(size + 1, **i32)
        self.kv_indices = torch.zeros(max_pages, **i32)
        self.kv_last_page_len = torch.ones(size, **i32)
        self.wrapper = BatchDecodeWithPagedKVCacheWrapper(
            runner.workspace, runner.pool.kv_layout, use_cuda_graph=True,
            paged_kv_indptr_buffer=self.kv_indptr, paged_kv_indices_buffer=self.kv_indices,
            paged_kv_last_page_len_buffer=self.kv_last_page_len)
        self.kv_lens: list[int] = [1] * size
        self.hidden: torch.Tensor | None = None
        self.runner = runner
        self.replay: Callable[[], None] | None = None

    def inputs(self, num_pages: int) -> StepInputs:
        table = PageTable(self.kv_indptr, self.kv_indices[:num_pages], self.kv_last_page_len,
                          self.kv_lens)
        return StepInputs(self.input_ids, self.positions, self.qo_indptr, self.batch_indices,
                          table, is_decode=True)

    def load(self, batch: ForwardBatch) -> int:
        """Copy a padded batch into the static buffers and plan; returns its page count."""
        r, ps = self.runner, self.runner.pool.page_size
        ends = self.kv_lens = [s + 1 for s in batch.starts]
        lists = [pages[:pages_needed(end, ps)] for pages, end in zip(batch.page_lists, ends)]
        short = [i for i, (pages, end) in enumerate(zip(lists, ends)) if len(pages) * ps < end]
        if short:
            raise ValueError(f"rows {short} hold fewer pages than their KV length needs")
        indptr = [0]
        for pages in lists:
            indptr.append(indptr[-1] + len(pages))
        flat = [p for pages in lists for p in pages]
        if len(flat) > self.kv_indices.numel():
            raise ValueError(f"{len(flat)} pages exceed the captured page table "
                             f"({self.kv_indices.numel()})")
        indptr_t = torch.tensor(indptr, dtype=torch.int32)
        flat_t = torch.tensor(flat, dtype=torch.int32)
        last_t = torch.tensor([(e - 1) % ps + 1 for e in ends], dtype=torch.int32)
        # the KV append inside the graph reads the static copies; plan() takes the host
        # ones (FlashInfer copies them into the same buffers, the CPU twin plans from them)
        self.input_ids.copy_(torch.tensor([t[0] for t in batch.token_ids]))
        self.positions.copy_(torch.tensor(batch.starts))
        self.kv_indices[:len(flat)].copy_(flat_t)
        self.kv_indptr.copy_(indptr_t)
        self.kv_last_page_len.copy_(last_t)
        cfg = r.model.config
        self.wrapper.plan(indptr_t.to(r.device), flat_t.to(r.device), last_t.to(r.device),
                          cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ps,
                          q_data_type=r.dtype, kv_data_type=r.pool.kv.dtype)
        return len(flat)

    def forward(self, num_pages: int) -> None:
        attn = PagedAttention(self.runner.pool, self.wrapper, self.inputs(num_pages))
        hidden = self.runner.model(self.input_ids, self.positions, attn)
        if self.hidden is None:
            self.hidden = hidden
        else:
            self.hidden.copy_(hidden)


class GraphedDecode:
    """Decode steps of ``model`` on ``pool``, each batch size captured on first use.

    ``scratch_page``: a page no sequence owns (the engine reserves one); padding rows
    write only there. Batches larger than the largest capture size, or whose sequences
    hold more than ``max_pages_per_seq`` pages, return None: run them eagerly."""

    def __init__(self, model, pool: KVPagePool, scratch_page: int, max_num_seqs: int,
                 max_pages_per_seq: int, graphs: GraphBackend | None = None):
        self.model, self.pool, self.scratch_page = model, pool, scratch_page
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.sizes = capture_sizes(max_num_seqs)
        self.max_pages_per_seq = max_pages_per_seq
        nbytes = 128 << 20 if self.device.type == "cuda" else 8
        self.workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.graphs = graphs or (CudaGraphs() if self.device.type == "cuda" else EagerGraphs())
        self.captured: dict[int, _Captured] = {}
        # the rotary table may not grow inside a graph (growing reads positions on the host)
        model_for_rope = getattr(model, "rotary_table", None)
        if model_for_rope is not None:
            model_for_rope().reserve(max_pages_per_seq * pool.page_size)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Pre-norm hidden states [len(batch), hidden] of a decode batch, or None when
        this batch cannot be replayed."""
        n = len(batch.token_ids)
        size = padded_size(n, self.sizes)
        if size is None or any(len(t) != 1 for t in batch.token_ids) or \
                any(s // self.pool.page_size >= self.max_pages_per_seq for s in batch.starts):
            return None
        cap = self.captured.get(size)
        if cap is None:
            cap = self.captured[size] = _Captured(self, size)
        padded = pad_decode_batch(batch, size, self.scratch_page)
        cap.load(padded)
        if cap.replay is None:
            # the graph reads the page table through fixed-size buffers: capture over all
            # of them, so any later page count replays the same kernels
            cap.replay = self.graphs.capture(lambda: cap.forward(cap.kv_indices.numel()))
            cap.load(padded)   # capture ran on this batch's inputs already; reload is cheap
        cap.replay()
        return cap.hidden[:n]
