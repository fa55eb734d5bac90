"""FlashInfer-shaped paged attention: FlashInfer on CUDA, pure torch elsewhere.

The engine calls these names exactly as it would call ``flashinfer``'s; the
device of the workspace buffer (wrappers) or of the appended keys (append)
picks the implementation, so there is one code path.  See ``layout`` for the
cache shapes and index conventions.
"""

from __future__ import annotations

import torch

from . import flashinfer_impl, torch_ref
from . import layout
from .layout import LAYOUTS

__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "append_paged_kv_cache",
    "append_slots",
    "get_batch_indices_positions",
    "LAYOUTS",
]


class _PagedWrapper:
    """FlashInfer's wrapper on a CUDA workspace, the torch twin otherwise; ``run`` per layer."""
    _flashinfer = None     # flashinfer_impl factory: (workspace, kv_layout, **kwargs) -> wrapper
    _torch = None          # torch_ref class: (workspace, kv_layout) -> wrapper

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kwargs):
        if flashinfer_impl.wanted(float_workspace_buffer):
            self._impl = self._flashinfer(float_workspace_buffer, kv_layout, **kwargs)
        else:
            self._impl = self._torch(float_workspace_buffer, kv_layout)

    def run(self, q: torch.Tensor, paged_kv_cache, **kwargs) -> torch.Tensor:
        """``q`` ``[tokens, num_qo_heads, head_dim]`` -> output of the same shape and dtype."""
        return self._impl.run(q, paged_kv_cache, **kwargs)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    """Prefill/append attention of ragged queries over a paged KV cache.

    ``plan()`` once per batch, ``run()`` once per layer.  With ``causal=True``
    query i of a request attends kv positions ``j <= i + kv_len - qo_len`` (the
    queries are the request's last ``qo_len`` tokens).

    >>> import torch
    >>> from tandem.backends.attention import BatchPrefillWithPagedKVCacheWrapper
    >>> cache = torch.randn(8, 2, 4, 2, 16)       # NHD: [pages, 2, page_size, kv_heads, dim]
    >>> w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.uint8), "NHD")
    >>> w.plan(torch.tensor([0, 3, 5], dtype=torch.int32),   # qo_indptr: 3 and 2 queries
    ...        torch.tensor([0, 2, 3], dtype=torch.int32),   # kv_indptr: 2 pages and 1 page
    ...        torch.tensor([5, 1, 6], dtype=torch.int32),   # kv_indices
    ...        torch.tensor([3, 4], dtype=torch.int32),      # kv_last_page_len -> kv_len 7 and 4
    ...        num_qo_heads=4, num_kv_heads=2, head_dim_qk=16, page_size=4, causal=True)
    >>> w.run(torch.randn(5, 4, 16), cache).shape
    torch.Size([5, 4, 16])
    """

    _flashinfer = staticmethod(flashinfer_impl.prefill_wrapper)
    _torch = torch_ref.TorchBatchPrefillWrapper

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None,
             q_data_type="float16", kv_data_type=None, **kwargs) -> None:
        """Index tensors are int32 in FlashInfer's CSR form; extra FlashInfer keywords pass through."""
        self._impl.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                        num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=causal,
                        sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type, **kwargs)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """Decode attention: one query per request over a paged KV cache.

    >>> import torch
    >>> from tandem.backends.attention import BatchDecodeWithPagedKVCacheWrapper
    >>> cache = torch.randn(8, 2, 2, 4, 16)       # HND: [pages, 2, kv_heads, page_size, dim]
    >>> w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.uint8), "HND")
    >>> w.plan(torch.tensor([0, 2, 3], dtype=torch.int32),   # kv_indptr
    ...        torch.tensor([5, 1, 6], dtype=torch.int32),   # kv_indices
    ...        torch.tensor([3, 4], dtype=torch.int32),      # kv_last_page_len
    ...        num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    >>> w.run(torch.randn(2, 4, 16), cache).shape
    torch.Size([2, 4, 16])
    """

    _flashinfer = staticmethod(flashinfer_impl.decode_wrapper)
    _torch = torch_ref.TorchBatchDecodeWrapper

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, sm_scale=None, q_data_type="float16", kv_data_type=None, **kwargs) -> None:
        self._impl.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                        page_size, sm_scale=sm_scale, q_data_type=q_data_type,
                        kv_data_type=kv_data_type, **kwargs)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD",
                          slots=None) -> None:
    """Write ragged K/V ``[nnz, num_kv_heads, head_dim]`` into the paged cache, in place.

    Token t goes to request ``batch_indices[t]`` at kv position ``positions[t]``
    (see :func:`get_batch_indices_positions`); the page table must already hold
    the pages those positions fall in. ``slots`` (a Tandem addition, CPU path only): the
    tokens' pages and offsets from :func:`append_slots`, so a step's layers compute them once.

    >>> import torch
    >>> cache = torch.zeros(4, 2, 2, 1, 1)        # NHD, page_size 2, 1 head, dim 1
    >>> k = torch.tensor([[[1.0]], [[2.0]], [[3.0]]])
    >>> append_paged_kv_cache(k, -k, torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]), cache,
    ...                       torch.tensor([3, 1]), torch.tensor([0, 2]), torch.tensor([2]))
    >>> cache[:, 0].flatten().tolist()            # pages 3 then 1; position 0 untouched
    [0.0, 0.0, 2.0, 3.0, 0.0, 0.0, 0.0, 1.0]
    """
    args = (append_key, append_value, batch_indices, positions, paged_kv_cache,
            kv_indices, kv_indptr, kv_last_page_len)
    if flashinfer_impl.wanted(append_key):
        flashinfer_impl.append_paged_kv_cache(*args, kv_layout=kv_layout)
    else:
        torch_ref.append_paged_kv_cache(*args, kv_layout=kv_layout, slots=slots)


def append_slots(batch_indices, positions, kv_indices, kv_indptr, page_size: int,
                 kv_layout: str | None = None, num_kv_heads: int | None = None):
    """The physical (page, offset) of each token an append will write, for the
    ``slots`` of :func:`append_paged_kv_cache`; None where FlashInfer computes them itself.
    Given the cache's layout and KV heads, also the rows its K and V go to in a stacked
    cache (:func:`~.layout.append_rows`): each layer's append is then one copy.

    >>> append_slots(torch.tensor([0, 1]), torch.tensor([3, 0]), torch.tensor([5, 8, 2]),
    ...              torch.tensor([0, 2, 3]), page_size=2)
    (tensor([8, 2]), tensor([1, 0]))
    """
    if flashinfer_impl.wanted(positions):
        return None
    page, slot = layout.token_slots(batch_indices, positions, kv_indices, kv_indptr, page_size)
    if kv_layout is None or num_kv_heads is None:
        return page, slot
    return page, slot, layout.append_rows(page, slot, layout.check_layout(kv_layout), num_kv_heads,
                                          page_size)


def get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices=None, positions=None):
    """Request index and kv position of each appended token; ``seq_lens`` are the kv
    lengths after the append.

    >>> get_batch_indices_positions(torch.tensor([0, 1, 3, 6, 10]), torch.tensor([5, 5, 5, 5]), 10)[1]
    tensor([4, 3, 4, 2, 3, 4, 1, 2, 3, 4], dtype=torch.int32)
    """
    if flashinfer_impl.wanted(append_indptr):
        return flashinfer_impl.get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices, positions)
    return torch_ref.get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices, positions)
