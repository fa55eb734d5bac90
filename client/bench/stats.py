"""The one percentile every benchmark reports its latencies with, so that a p99 of one
benchmark compares with a p99 of another.

>>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([5.0], 99), percentile([], 50)
(2.5, 5.0, None)
>>> ms(0.0123456), ms(0.0123456, digits=1), ms(None)
(12.35, 12.3, None)
"""
from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in 0..100) by linear interpolation between the
    closest ranks: numpy's default (``method="linear"``, Hyndman and Fan's type 7).
    The sorted values stand at positions 0..n-1 and the percentile at ``(n - 1) * q / 100``,
    between the two values around it; so p0 is the minimum, p100 the maximum and p50
    the median. None of no values.

    >>> percentile([10.0, 20.0, 30.0], 25), percentile([3.0, 1.0, 2.0], 100)
    (15.0, 3.0)
    """
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is of 0..100, got {q!r}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(seconds: float | None, digits: int = 2) -> float | None:
    """Seconds as milliseconds, rounded for a report; None stays None."""
    return None if seconds is None else round(1000 * seconds, digits)
