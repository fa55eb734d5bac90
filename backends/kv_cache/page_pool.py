"""KV page memory for all layers of one model, in FlashInfer's paged shapes."""
from __future__ import annotations

from typing import Protocol

import torch


class KVShape(Protocol):
    """What a pool needs of a model (a ``ModelConfig`` has it)."""
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


def page_shape(kv_layout: str, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one page ([2, H, page_size, D] for HND, [2, page_size, H, D] for NHD)."""
    if kv_layout == "HND":
        return (2, num_kv_heads, page_size, head_dim)
    if kv_layout == "NHD":
        return (2, page_size, num_kv_heads, head_dim)
    raise ValueError(f"kv_layout {kv_layout!r} is not supported; allowed: HND, NHD")


class KVPagePool:
    """``[num_layers, num_pages, *page_shape]`` in one allocation.

    ``layer(i)`` is the ``paged_kv_cache`` tensor FlashInfer's wrappers take. In HND a
    page of one layer is one contiguous block per K and V, which the KV transfer sends
    as one write.
    """

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int,
                 head_dim: int, dtype: torch.dtype, kv_layout: str = "HND",
                 device: torch.device | str = "cpu", buffer: torch.Tensor | None = None):
        self.kv_layout = kv_layout
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_layers, num_pages, *page_shape(kv_layout, num_kv_heads, page_size, head_dim))
        if buffer is None:
            # zeros() touches every page, so no page faults later on the hot path
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.kv = buffer.view(dtype).view(shape)

    @classmethod
    def for_model(cls, model: KVShape, num_pages: int, page_size: int, dtype: torch.dtype,
                  kv_layout: str = "HND", device: torch.device | str = "cpu",
                  buffer: torch.Tensor | None = None) -> "KVPagePool":
        """A pool with ``model``'s geometry: all its layers and KV heads."""
        return cls(model.num_hidden_layers, num_pages, model.num_key_value_heads, page_size,
                   model.head_dim, dtype, kv_layout, device, buffer)

    def layer(self, i: int) -> torch.Tensor:
        return self.kv[i]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer (K and V)."""
        return self.kv[0, 0].numel() * self.kv.element_size()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
