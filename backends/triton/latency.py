"""Per-stream latency bookkeeping and counter deltas, without Triton.

>>> clock = StreamClock(start=10.0)
>>> clock.tokens(2, now=10.25)      # first token: TTFT
(0.25, None)
>>> clock.tokens(3, now=10.5)       # later responses: the gap since the previous one
(None, 0.25)
>>> clock.tokens(0, now=10.4)       # a response without tokens observes nothing
(None, None)
"""
from __future__ import annotations

import time


class StreamClock:
    """Time to first token and inter-token latency of one stream.

    TTFT runs from ``start`` (when the model received the request) to the first
    response carrying tokens; ITL is the gap between consecutive token-carrying
    responses (a speculative step that emits several tokens counts once, as vLLM's
    inter-token latency does)."""

    __slots__ = ("start", "last")

    def __init__(self, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.last: float | None = None

    def tokens(self, n: int, now: float | None = None) -> tuple[float | None, float | None]:
        """``n`` tokens arrived; returns (ttft, itl), each None when not observed."""
        if n <= 0:
            return None, None
        now = time.monotonic() if now is None else now
        last, self.last = self.last, now
        if last is None:
            return now - self.start, None
        return None, now - last


class Deltas:
    """Turns cumulative totals read from elsewhere into increments for counters.

    >>> d = Deltas()
    >>> d.take("bytes", 100), d.take("bytes", 250), d.take("bytes", 250)
    (100, 150, 0)
    """

    def __init__(self):
        self._seen: dict = {}

    def take(self, key, total: float) -> float:
        prev = self._seen.get(key, 0)
        self._seen[key] = total
        return max(total - prev, 0)
