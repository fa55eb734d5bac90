"""Closed-loop load through Triton's gRPC stream: :func:`closed_loop` keeps a number of
requests in flight on each :class:`~.request_client.TritonStream` (a request sent as one
ends) and reports throughput, TTFT and per-request decode speed.

>>> stream = TritonStream(server.grpc_url, "tandem")                               # doctest: +SKIP
>>> closed_loop([stream], prompts, prompt_tokens=8, streams=4, max_tokens=32, duration=10)  # doctest: +SKIP
{'requests': 41, 'errors': 0, 'requests_per_s': 4.1, ...}
"""
from __future__ import annotations

import statistics
import time

from tandem.client.bench.request_client import RequestInput, TritonStream
from tandem.client.bench.stats import ms, percentile


def closed_loop(clients: list[TritonStream], prompts: list[str], prompt_tokens: int,
                streams: int, max_tokens: int, duration: float) -> dict:
    """Keep ``streams`` requests in flight on every client for ``duration`` seconds."""
    def send(c: TritonStream, i: int) -> None:
        c.send(RequestInput(prompts[i % len(prompts)], max_tokens, kind="long", prompt_tokens=prompt_tokens))

    for c in clients:   # what an earlier loop left behind is not this loop's
        while not c.finished.empty():
            c.finished.get()
        for j in range(streams):
            send(c, j)
    start = time.perf_counter()
    done = []
    n = 0
    while time.perf_counter() - start < duration:
        for c in clients:
            while not c.finished.empty():
                out = c.finished.get()
                if out.error:   # counted from the client's errors; its request is not replaced
                    continue
                done.append(out)
                n += 1
                if time.perf_counter() - start < duration:
                    send(c, n)
        time.sleep(0.01)
    end = time.perf_counter()
    deadline = end + 120
    for c in clients:   # drain what is still running (not counted)
        while any(out.end is None for out in c.outputs.values()) and time.perf_counter() < deadline:
            time.sleep(0.05)
    warm = start + min(5.0, duration / 4)
    counted = [out for out in done if out.start >= warm and out.end and out.end <= end]
    span = end - warm
    ttfts = [out.ttft_s for out in counted if out.ttft_s is not None]
    speeds = [v for out in counted for v in [out.decode_tokens_per_s()] if v is not None]
    out_tokens = sum(sum(out.chunk_tokens) for out in counted)
    errors = sum(len(c.errors) for c in clients)
    return {
        "requests": len(counted), "errors": errors,
        "requests_per_s": round(len(counted) / span, 3),
        "prefill_tokens_per_s": round(len(counted) * prompt_tokens / span, 1),
        "output_tokens_per_s": round(out_tokens / span, 1),
        "ttft_ms_p50": ms(percentile(ttfts, 50), 1), "ttft_ms_p90": ms(percentile(ttfts, 90), 1),
        "decode_tok_s_median": round(statistics.median(speeds), 1) if speeds else None,
    }
