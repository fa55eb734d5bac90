"""Rotary position embeddings (NeoX half-rotation, as HF Llama/Qwen), with llama3 scaling."""
from __future__ import annotations

import math

import torch

from .config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-frequency inverse wavelengths [head_dim // 2], float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin rows for positions, computed once and grown on demand."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype=torch.float32):
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        self.dtype = dtype
        self._build(max(cfg.max_position_embeddings, 1))

    def _build(self, length: int) -> None:
        pos = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype)
        # the rotation's sign folded into sin: rotate_half(x) * sin == x.roll(half) * sin
        # with the first half negated (exactly: only signs move), one op instead of four
        half = emb.shape[-1] // 2
        self.sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1).to(self.dtype)

    def reserve(self, length: int) -> None:
        """Make the table cover positions ``0..length - 1``."""
        if length > self.cos.shape[0]:
            self._build(length)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see :func:`apply_rope`) of shape [N, 1, head_dim] for int
        positions [N]."""
        # on a GPU the table is sized up front (reserve): reading positions back would
        # synchronise every step and cannot run inside a CUDA graph
        if positions.device.type == "cpu" and positions.numel() and \
                int(positions.max()) >= self.cos.shape[0]:
            self._build(2 * int(positions.max()) + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos and signed sin from :meth:`RotaryTable.lookup`:
    [N, 1, head_dim]. The same values as HF's ``x * cos + rotate_half(x) * sin``.

    >>> x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    >>> cos, sin = torch.tensor([0.5, 0.25, 0.5, 0.25]), torch.tensor([-2.0, -4.0, 2.0, 4.0])
    >>> apply_rope(x, cos, sin)   # [1, 2, 3, 4] * cos + [-3, -4, 1, 2] * |sin|
    tensor([[[ -5.5000, -15.5000,   3.5000,   9.0000]]])
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
