"""One load generator for any OpenAI-compatible server: :class:`RequestInput`\\ s sent as
streams (:mod:`.request_client`) in a closed loop at a fixed concurrency, and a level's
figures from what came back.

Per request the client records the time to the first text, the gap before every later
chunk that carries text, the reply's text, and the completion, prompt and cached prompt
tokens the final usage chunk reports.

>>> r = RequestOutput("cold", chunk_s=[0.1, 0.2, 0.4], output_tokens=4)
>>> s = summarize([r], wall_s=2.0); s["output_tok_s"], s["ttft_cold_ms_p50"], s["itl_ms_p50"]
(2.0, 100.0, 150.0)
"""
from __future__ import annotations

import asyncio
import time

from tandem.client.bench.request_client import RequestInput, RequestOutput, openai_completion
from tandem.client.bench.stats import ms, percentile


async def closed_loop(host: str, port: int, requests: list[RequestInput], concurrency: int,
                      send=openai_completion) -> tuple[list[RequestOutput], float]:
    """``requests``, ``concurrency`` at a time, each next one sent as one ends (by
    ``send``: completions, or :func:`~.request_client.openai_chat`); the outputs in order
    and the wall time from the first send to the last end."""
    pending = list(enumerate(requests))
    out: list[RequestOutput | None] = [None] * len(requests)

    async def worker():
        while pending:
            i, inp = pending.pop(0)
            out[i] = await send(host, port, inp)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return out, time.perf_counter() - t0


def run_closed_loop(host: str, port: int, requests: list[RequestInput], concurrency: int):
    return asyncio.run(closed_loop(host, port, requests, concurrency))


def summarize(results: list[RequestOutput], wall_s: float) -> dict:
    """A level's figures: output tok/s (all completion tokens over the wall time), TTFT
    p50/p99 of each kind of prompt, ITL p50/p99 (gaps between text chunks, as a user
    sees them), TPOT p50 (a request's (end - TTFT) / (tokens - 1): per token, however
    many a chunk carried), tokens per chunk, requests and errors."""
    ok = [r for r in results if r.error is None and r.chunk_s]
    gaps = [g for r in ok for g in r.itl_s]
    tpot = [(r.chunk_s[-1] - r.chunk_s[0]) / (r.tokens - 1) for r in ok if r.tokens > 1]
    tokens = sum(r.tokens for r in ok)
    out = {"requests": len(results), "errors": len(results) - len(ok),
           "output_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
           "completion_tokens_mean": round(tokens / len(ok), 1) if ok else None,
           "tokens_per_chunk": round(tokens / sum(len(r.chunk_s) for r in ok), 3) if ok else None,
           "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p99": ms(percentile(gaps, 99)),
           "tpot_ms_p50": ms(percentile(tpot, 50))}
    for kind in sorted({r.kind for r in results}):
        ttft = [r.ttft_s for r in ok if r.kind == kind]
        out[f"ttft_{kind}_ms_p50"] = ms(percentile(ttft, 50))
        out[f"ttft_{kind}_ms_p99"] = ms(percentile(ttft, 99))
    errors = [r.error for r in results if r.error]
    if errors:
        out["first_error"] = errors[0][:300]
    return out
