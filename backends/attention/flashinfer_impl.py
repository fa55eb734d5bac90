"""Thin delegation to FlashInfer for CUDA tensors.

``flashinfer`` is imported on first use with a CUDA tensor, never at module
import time, so CPU-only installs neither need nor load it.
"""

from __future__ import annotations

import functools
import importlib

import torch


@functools.cache
def available() -> bool:
    try:
        importlib.import_module("flashinfer")
    except (ImportError, OSError):  # not installed, or built against another CUDA
        return False
    return True


def wanted(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on CUDA and FlashInfer can serve it."""
    return tensor.is_cuda and available()


def _flashinfer():
    return importlib.import_module("flashinfer")


def prefill_wrapper(float_workspace_buffer: torch.Tensor, kv_layout: str, **kwargs):
    return _flashinfer().BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, **kwargs)


def decode_wrapper(float_workspace_buffer: torch.Tensor, kv_layout: str, **kwargs):
    return _flashinfer().BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, **kwargs)


def append_paged_kv_cache(*args, **kwargs) -> None:
    _flashinfer().append_paged_kv_cache(*args, **kwargs)


def get_batch_indices_positions(*args, **kwargs):
    return _flashinfer().get_batch_indices_positions(*args, **kwargs)
