"""The serving benchmark's workload and statistics, without a server.

A run keeps ``background`` streams decoding all the time (each restarted when it
ends) while long prompts arrive on a Poisson schedule; every response is logged
with its arrival time and token count, and :func:`summarize` turns the logs into
what the seeds compare: per-request decode tokens/s, time to first token, and
inter-token latency percentiles (the prefill stalls show in the tail).

>>> poisson_arrivals(0.0, 10.0, seed=1)
[]
>>> xs = poisson_arrivals(2.0, 100.0, seed=1); 150 < len(xs) < 250 and xs == sorted(xs)
True
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process of ``rate`` per second."""
    if rate <= 0:
        return []
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


@dataclass(slots=True)
class StreamLog:
    """One request: when it was sent, and (time, new tokens) per token-carrying response."""
    request_id: str
    kind: str                     # "long" (an arriving long prompt) | "background"
    prompt_tokens: int
    sent_at: float
    events: list[tuple[float, int]] = field(default_factory=list)
    done_at: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.events[0][0] - self.sent_at if self.events else None

    def gaps(self) -> list[tuple[float, float]]:
        """(time, gap since the previous token-carrying response)."""
        return [(b[0], b[0] - a[0]) for a, b in zip(self.events, self.events[1:])]

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time they took (None with fewer than two
        responses)."""
        if len(self.events) < 2:
            return None
        span = self.events[-1][0] - self.events[0][0]
        n = sum(k for _, k in self.events[1:])
        return n / span if span > 0 else None


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return None
    s = sorted(xs)
    i = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s) - 1e-9) - 1))
    return s[i]


def summarize(logs: list[StreamLog], window: tuple[float, float]) -> dict:
    """Statistics of the responses inside ``window`` (absolute times): the warm-up
    and the drain at the end are left out."""
    lo, hi = window
    gaps = [g for log in logs for t, g in log.gaps() if lo <= t <= hi]
    speeds = [v for log in logs if log.events and lo <= log.events[0][0] and log.events[-1][0] <= hi
              for v in [log.decode_tokens_per_s()] if v is not None]
    ttfts = [log.ttft for log in logs if log.kind == "long" and log.ttft is not None
             and lo <= log.sent_at <= hi]
    errors = sum(1 for log in logs if log.error is not None)

    def pct(xs, q):
        v = percentile(xs, q)
        return None if v is None else round(v * 1000, 2)
    return {
        "requests_long": sum(1 for log in logs if log.kind == "long" and lo <= log.sent_at <= hi),
        "errors": errors,
        "decode_tok_s_median": round(statistics.median(speeds), 1) if speeds else None,
        "decode_tok_s_p10": round(percentile(speeds, 10), 1) if speeds else None,
        "ttft_ms_p50": pct(ttfts, 50), "ttft_ms_p90": pct(ttfts, 90),
        "itl_ms_p50": pct(gaps, 50), "itl_ms_p90": pct(gaps, 90), "itl_ms_p99": pct(gaps, 99),
        "itl_ms_max": round(max(gaps) * 1000, 2) if gaps else None,
    }
