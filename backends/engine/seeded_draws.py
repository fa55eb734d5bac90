"""The random numbers of a seeded request: one uniform per output position, a pure
function of (seed, position).

A seeded token is drawn by inverting its distribution's CDF at the position's uniform.
Nothing is consumed from a stream, so the token at position ``t`` depends on the seed,
``t`` and the distribution alone: not on the batch, not on a retried step, and not on
speculation. Verifying greedy drafts with the same draws (sample every position, keep
drafts while they equal the samples) is exactly lossless: the emitted token is a draw
from the target's distribution, and a draft ``x`` survives with probability ``p(x)``, as
the rejection sampler's ``min(1, p/q)`` with one-hot ``q`` gives. So a seeded request
returns the same tokens with speculation off, on, at any ``k``, adaptive or not.

>>> seeded_uniforms(7, [0, 1, 2]) == seeded_uniforms(7, [0, 1, 2])
True
>>> seeded_uniforms(7, [2]) == seeded_uniforms(7, [0, 1, 2])[2:]
True
>>> inverse_cdf(torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 2), torch.tensor([0.25, 0.75])).tolist()
[1, 3]
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a bijection of 64-bit words that scatters nearby
    inputs (seed, seed + 1, position, position + 1) far apart."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def seeded_uniforms(seed: int, positions: Iterable[int]) -> list[float]:
    """Uniforms in [0, 1) for ``positions`` (output token indices) of request ``seed``."""
    key = _splitmix64(seed & _MASK)
    return [(_splitmix64(key ^ (t * _GOLDEN & _MASK)) >> 11) * 2.0 ** -53 for t in positions]


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[..., V] distributions (any positive mass) and [...] uniforms in [0, 1) -> the
    tokens [...]: for each row the first token whose cumulative mass exceeds ``u`` times
    the total. A token of zero probability is never picked (the cumulative mass does not
    rise there); the sums run in float64 so that a 49k vocabulary keeps its small tails."""
    c = probs.double().cumsum(-1)
    total = c[..., -1:]
    # strictly below the total, so the search always lands on a token of positive mass
    x = torch.minimum(uniforms.double().to(c.device)[..., None] * total, total * (1 - 2.0 ** -52))
    return torch.searchsorted(c, x, right=True)[..., 0]
