"""Pure-torch paged attention (the CPU path): plan once per batch, run per layer.

``run()`` per group: one ``index_select`` gathers every page of K and V into a
reused buffer, one ``scaled_dot_product_attention`` call attends, and padded
rows are dropped with one ``index_copy_``.  No Python loop over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernel, layout
from .batch_plan import AttentionGroup, BatchPlan, plan_batch

# plan() keywords that change the maths: accepted only at their neutral value.
_NEUTRAL = {
    "pos_encoding_mode": ("NONE",),
    "window_left": (-1, None),
    "logits_soft_cap": (None, 0, 0.0),
    "custom_mask": (None,),
    "packed_custom_mask": (None,),
    "rope_scale": (None,),
    "rope_theta": (None,),
}


def _check_neutral(kwargs: dict) -> None:
    for name, value in kwargs.items():
        allowed = _NEUTRAL.get(name)
        if allowed is not None and not any(value is a or value == a for a in allowed):
            raise NotImplementedError(f"the CPU attention path does not support {name}={value!r}")


class _PagedAttention:
    """Shared plan/run machinery of the prefill and decode wrappers."""

    def __init__(self, float_workspace_buffer: torch.Tensor | None, kv_layout: str = "NHD"):
        self._kv_layout = layout.check_layout(kv_layout)
        self._plan: BatchPlan | None = None
        self._kernel_indices: tuple[torch.Tensor, ...] = ()   # the C++ kernel's, when plan.kernel
        self._causal = False
        self._kv_buffer: torch.Tensor | None = None  # gathered K/V pages, reused across layers

    def _plan_batch(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim, page_size, causal, sm_scale, head_dim_vo=None, **kwargs):
        _check_neutral(kwargs)
        if head_dim_vo not in (None, head_dim):
            raise NotImplementedError("the CPU attention path needs head_dim_vo == head_dim_qk")
        on_cpu = kv_indices.device.type == "cpu"
        self._plan = plan = plan_batch(
            qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            page_size=page_size, causal=causal, sm_scale=sm_scale,
            kernel_max_qo=cpu_kernel.MAX_QO_LEN if on_cpu and cpu_kernel.load() else 0,
        )
        self._causal = causal
        self._kernel_indices = () if not plan.kernel else tuple(
            t.to(torch.int64).contiguous() for t in (qo_indptr, kv_indptr, kv_indices)
        ) + (torch.tensor(plan.kv_lens, dtype=torch.int64),)

    def _run(self, q: torch.Tensor, paged_kv_cache, out: torch.Tensor | None, return_lse: bool):
        plan = self._plan
        if plan is None:
            raise RuntimeError("call plan() before run()")
        if return_lse:
            raise NotImplementedError("return_lse is not supported on the CPU attention path")
        if q.shape != (plan.nnz_qo, plan.num_qo_heads, plan.head_dim):
            raise ValueError(
                f"q must be [nnz_qo, num_qo_heads, head_dim] = "
                f"{[plan.nnz_qo, plan.num_qo_heads, plan.head_dim]}, got {list(q.shape)}"
            )
        stacked = not isinstance(paged_kv_cache, (tuple, list))
        if plan.kernel:
            self._check_cache(plan, paged_kv_cache, stacked)
            k_cache, v_cache = layout.split_cache(paged_kv_cache, self._kv_layout)
            o = cpu_kernel.paged_attention(q, k_cache, v_cache, self._kv_layout == "HND",
                                           *self._kernel_indices, plan.num_kv_heads, self._causal,
                                           plan.sm_scale)
            return o if out is None else out.copy_(o)
        rows = self._cache_rows(plan, paged_kv_cache, stacked)
        if plan.identity:
            o = self._attend(plan, plan.groups[0], q, rows, stacked)
            return o if out is None else out.copy_(o)
        if out is None:
            out = q.new_empty(q.shape)
        for group in plan.groups:
            o = self._attend(plan, group, q, rows, stacked)
            if group.out_src is not None:
                o = o.index_select(0, group.out_src)
            out.index_copy_(0, group.out_dst, o)
        return out

    def _cache_rows(self, plan: BatchPlan, paged_kv_cache, stacked: bool) -> tuple[torch.Tensor, ...]:
        """2-D row views of the cache (one, or one per k/v cache) after checking its shape."""
        caches = self._check_cache(plan, paged_kv_cache, stacked)
        return tuple(layout.cache_rows(c, self._kv_layout, stacked) for c in caches)

    def _check_cache(self, plan: BatchPlan, paged_kv_cache, stacked: bool) -> tuple[torch.Tensor, ...]:
        """The cache (one, or one per k/v cache), its shape checked against the plan."""
        if self._kv_layout == "NHD":
            inner = (plan.page_size, plan.num_kv_heads, plan.head_dim)
        else:
            inner = (plan.num_kv_heads, plan.page_size, plan.head_dim)
        caches = (paged_kv_cache,) if stacked else tuple(paged_kv_cache)
        shapes = [tuple(c.shape) for c in caches]
        if stacked:
            ok = len(shapes[0]) == 5 and shapes[0][1] == 2 and shapes[0][2:] == inner
        else:
            ok = len(shapes) == 2 and shapes[0] == shapes[1] and shapes[0][1:] == inner
        if not ok:
            want = f"[max_num_pages, 2, {', '.join(map(str, inner))}]"
            raise ValueError(
                f"{self._kv_layout} paged_kv_cache must be {want} (or a tuple of two without the 2) "
                f"to match the plan, got shapes {shapes}"
            )
        return caches

    def _attend(self, plan: BatchPlan, group: AttentionGroup, q: torch.Tensor, rows, stacked: bool) -> torch.Tensor:
        """SDPA of one group; returns padded output rows ``[num_reqs * qo_max, Hq, D]``."""
        n, qo_max = group.num_reqs, group.qo_max
        hq, hkv, d = plan.num_qo_heads, plan.num_kv_heads, plan.head_dim
        g = hq // hkv
        qp = q if group.q_rows is None else q.index_select(0, group.q_rows)
        if group.fold_heads:
            if qo_max == 1:
                qx = qp.reshape(n, hkv, g, d)
            else:
                qx = qp.reshape(n, qo_max, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, qo_max * g, d)
        else:
            qx = qp.reshape(n, qo_max, hq, d).transpose(1, 2)
        k, v = self._gather_kv(plan, group, rows, stacked)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(
            qx, k, v,
            attn_mask=self._float_mask(group, q.dtype),
            is_causal=group.is_causal,
            scale=plan.sm_scale,
            enable_gqa=not group.fold_heads and g > 1,
        )
        if group.fold_heads:
            o = o.reshape(n, hkv, qo_max, g, d).permute(0, 2, 1, 3, 4) if qo_max > 1 else o
        else:
            o = o.transpose(1, 2)
        return o.reshape(n * qo_max, hq, d)

    def _gather_kv(self, plan: BatchPlan, group: AttentionGroup, rows, stacked: bool):
        """K and V of the group's pages as ``[n, num_kv_heads, kv_max, head_dim]`` views."""
        views = group.gather.get((stacked, rows[0].dtype))
        if views is None:
            self._prepare_gather(plan, rows, stacked)
            views = group.gather[(stacked, rows[0].dtype)]
        index, outs, k, v = views
        for r, o in zip(rows, outs):
            torch.index_select(r, 0, index, out=o)
        return k, v

    def _prepare_gather(self, plan: BatchPlan, rows, stacked: bool) -> None:
        """Once per plan: the row index of every group, and fixed views of one reused
        buffer that the gathered rows land in (so run() is one index_select per cache)."""
        # Normal (not inference-mode) tensors, so a plan made under torch.inference_mode()
        # may still run outside it, and the buffer may outlive either mode.
        with torch.inference_mode(False):
            self._prepare_gather_views(plan, rows, stacked)

    def _prepare_gather_views(self, plan: BatchPlan, rows, stacked: bool) -> None:
        width, dtype, device = rows[0].shape[1], rows[0].dtype, rows[0].device
        indices = [
            layout.gather_row_index(g.pages, self._kv_layout, plan.num_kv_heads, stacked).view(-1).to(device)
            for g in plan.groups
        ]
        need = max(i.numel() for i in indices) * width * (1 if stacked else 2)
        buf = self._kv_buffer
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            buf = self._kv_buffer = torch.empty(need, dtype=dtype, device=device)
        for group, index in zip(plan.groups, indices):
            gathered = buf[: index.numel() * width * (1 if stacked else 2)].view(2, -1, width)
            outs = (gathered.view(-1, width),) if stacked else tuple(gathered)
            k, v = (
                layout.gathered_to_bhld(half, self._kv_layout, group.num_reqs, plan.num_kv_heads, plan.head_dim)
                for half in gathered
            )
            kv_max = group.kv_max
            if k.shape[2] != kv_max:
                k, v = k[:, :, :kv_max], v[:, :, :kv_max]
            group.gather[(stacked, dtype)] = (index, outs, k, v)

    @staticmethod
    def _float_mask(group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor | None:
        # SDPA on CPU runs a little faster with an additive mask than a bool one.
        if group.mask is None:
            return None
        mask = group.float_mask.get(dtype)
        if mask is None:
            mask = torch.zeros(group.mask.shape, dtype=dtype, device=group.mask.device)
            mask.masked_fill_(~group.mask, float("-inf"))
            group.float_mask[dtype] = mask
        return mask


class TorchBatchPrefillWrapper(_PagedAttention):
    """CPU twin of ``flashinfer.BatchPrefillWithPagedKVCacheWrapper``."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None,
             q_data_type="float16", kv_data_type=None, **kwargs) -> None:
        self._plan_batch(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                         num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale, **kwargs)

    def run(self, q, paged_kv_cache, *, out=None, return_lse=False):
        return self._run(q, paged_kv_cache, out, return_lse)

    forward = run


class TorchBatchDecodeWrapper(_PagedAttention):
    """CPU twin of ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (one query per request)."""

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, sm_scale=None, q_data_type="float16", kv_data_type=None, **kwargs) -> None:
        kwargs.pop("data_type", None)
        batch = last_page_len.numel()
        qo_indptr = torch.arange(batch + 1)
        self._plan_batch(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                         head_dim, page_size, False, sm_scale, **kwargs)

    def run(self, q, paged_kv_cache, *, out=None, return_lse=False):
        return self._run(q, paged_kv_cache, out, return_lse)

    forward = run


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD",
                          slots=None) -> None:
    """Write ragged K/V ``[nnz, num_kv_heads, head_dim]`` into their pages, in place;
    ``slots``: their ``layout.token_slots``, if the caller computed them already, and
    optionally third their ``layout.append_rows`` (a stacked contiguous cache then takes
    one ``index_copy_``: a decode step's layers each append a few rows, and the indexed
    assignment below costs several times more)."""
    if slots is not None and len(slots) == 3 and not isinstance(paged_kv_cache, (tuple, list)):
        head_dim = paged_kv_cache.shape[-1]
        if append_key.shape != append_value.shape or append_key.shape[-1] != head_dim \
                or slots[2].numel() != 2 * append_key.shape[0] * append_key.shape[1]:
            raise ValueError(f"append_key/append_value must be [nnz, num_kv_heads, {head_dim}] "
                             f"as the slots were planned, got {tuple(append_key.shape)} and "
                             f"{tuple(append_value.shape)}")
        kv = torch.stack((append_key, append_value), 1).to(paged_kv_cache.dtype)
        rows = layout.cache_rows(paged_kv_cache, "NHD", True).view(-1, head_dim)   # contiguous only
        rows.index_copy_(0, slots[2], kv.view(-1, head_dim))
        return
    layout.check_layout(kv_layout)
    k_cache, v_cache = layout.split_cache(paged_kv_cache, kv_layout)
    page_size, num_kv_heads, head_dim = layout.cache_geometry(k_cache, kv_layout)
    if append_key.shape[1:] != (num_kv_heads, head_dim) or append_value.shape != append_key.shape:
        raise ValueError(
            f"append_key/append_value must be [nnz, {num_kv_heads}, {head_dim}], got "
            f"{tuple(append_key.shape)} and {tuple(append_value.shape)}"
        )
    page, slot = slots[:2] if slots is not None else \
        layout.token_slots(batch_indices, positions, kv_indices, kv_indptr, page_size)
    if not isinstance(paged_kv_cache, (tuple, list)):
        # one write for K and V: [page, :, slot] (NHD) or [page, :, :, slot] (HND) puts the
        # token dimension first, then k/v: [nnz, 2, num_kv_heads, head_dim]
        kv = torch.stack((append_key, append_value), 1).to(paged_kv_cache.dtype)
        if kv_layout == "NHD":
            paged_kv_cache[page, :, slot] = kv
        else:
            paged_kv_cache[page, :, :, slot] = kv
    elif kv_layout == "NHD":
        k_cache[page, slot] = append_key.to(k_cache.dtype)
        v_cache[page, slot] = append_value.to(v_cache.dtype)
    else:  # [page, :, slot] puts the token dimension first: [nnz, num_kv_heads, head_dim]
        k_cache[page, :, slot] = append_key.to(k_cache.dtype)
        v_cache[page, :, slot] = append_value.to(v_cache.dtype)


def get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices=None, positions=None):
    """Request index and KV position of each appended token (FlashInfer semantics)."""
    batch, pos = layout.batch_indices_positions(append_indptr, seq_lens, nnz)
    if batch_indices is not None:
        batch = batch_indices.copy_(batch)
    if positions is not None:
        pos = positions.copy_(pos)
    return batch, pos
