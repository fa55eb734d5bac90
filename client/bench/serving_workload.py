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

import random
import statistics

from tandem.client.bench.request_client import RequestOutput
from tandem.client.bench.stats import ms, percentile


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


def timed_gaps(out: RequestOutput) -> list[tuple[float, float]]:
    """(when, gap since the previous token-carrying response) of one request, ``when`` on
    the clock the request's ``start`` is on (a rate's window is)."""
    return [(out.start + b, b - a) for a, b in zip(out.chunk_s, out.chunk_s[1:])]


def summarize(outputs: list[RequestOutput], window: tuple[float, float]) -> dict:
    """Statistics of the responses inside ``window`` (absolute times): the warm-up
    and the drain at the end are left out."""
    lo, hi = window
    gaps = [g for r in outputs for t, g in timed_gaps(r) if lo <= t <= hi]
    speeds = [v for r in outputs if r.chunk_s and lo <= r.start + r.chunk_s[0] and r.start + r.chunk_s[-1] <= hi
              for v in [r.decode_tokens_per_s()] if v is not None]
    longs = [r for r in outputs if r.kind == "long" and lo <= r.start <= hi]
    ttfts = [r.ttft_s for r in longs if r.ttft_s is not None]
    return {
        "requests_long": len(longs),
        "errors": sum(1 for r in outputs if r.error is not None),
        "decode_tok_s_median": round(statistics.median(speeds), 1) if speeds else None,
        "decode_tok_s_p10": round(percentile(speeds, 10), 1) if speeds else None,
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p90": ms(percentile(ttfts, 90)),
        "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p90": ms(percentile(gaps, 90)),
        "itl_ms_p99": ms(percentile(gaps, 99)),
        "itl_ms_max": ms(max(gaps)) if gaps else None,
    }
