"""Load through a real server: :class:`StreamingClient` multiplexes every request
over one gRPC stream and logs each response's time (a
:class:`~tandem.client.bench.serving_workload.StreamLog` per request); :func:`closed_loop`
keeps a number of requests in flight on each client and reports throughput and TTFT.

>>> client = StreamingClient(server.grpc_url, "tandem")            # doctest: +SKIP
>>> closed_loop([client], prompts, prompt_tokens=8, streams=4, max_tokens=32, duration=10)  # doctest: +SKIP
{'requests': 41, 'errors': 0, 'requests_per_s': 4.1, ...}
"""
from __future__ import annotations

import queue
import statistics
import threading
import time

from tandem.client.bench.serving_workload import StreamLog, percentile


class StreamingClient:
    """One gRPC stream multiplexing every request; logs each response's time."""

    def __init__(self, url: str, model: str):
        import tritonclient.grpc as grpcclient
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self.logs: dict[str, StreamLog] = {}
        self.errors: list[str] = []   # error responses (the stream does not say whose)
        self.finished: queue.Queue = queue.Queue()
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()
        self.client.start_stream(callback=self._on_response)

    def send(self, kind: str, prompt: str, prompt_tokens: int, max_tokens: int) -> str:
        from tandem.client.generate import build_inputs
        rid = f"{kind}-{next(self._ids)}"
        log = StreamLog(rid, kind, prompt_tokens, time.monotonic())
        with self._lock:
            self.logs[rid] = log
        inputs = build_inputs(prompt, max_tokens=max_tokens, stream=True, temperature=0.0)
        self.client.async_stream_infer(self.model, inputs, request_id=rid,
                                       enable_empty_final_response=True)
        return rid

    def _on_response(self, result, error) -> None:
        now = time.monotonic()
        if error is not None:
            self.errors.append(str(error))
            return
        from tandem.client.generate import parse_response
        r = parse_response(result)
        rid = result.get_response().id
        log = self.logs.get(rid)
        if log is None:
            return
        seen = sum(k for _, k in log.events)
        if r.num_output_tokens > seen:
            log.events.append((now, r.num_output_tokens - seen))
        if r.final:
            log.done_at = now
            self.finished.put(log)

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def closed_loop(clients: list[StreamingClient], prompts: list[str], prompt_tokens: int,
                streams: int, max_tokens: int, duration: float) -> dict:
    """Keep ``streams`` requests in flight on every client for ``duration`` seconds."""
    for c in clients:   # what an earlier loop left behind is not this loop's
        while not c.finished.empty():
            c.finished.get()
        for j in range(streams):
            c.send("long", prompts[j % len(prompts)], prompt_tokens, max_tokens)
    start = time.monotonic()
    done = []
    n = 0
    while time.monotonic() - start < duration:
        for c in clients:
            while not c.finished.empty():
                log = c.finished.get()
                done.append(log)
                n += 1
                if time.monotonic() - start < duration:
                    c.send("long", prompts[n % len(prompts)], prompt_tokens, max_tokens)
        time.sleep(0.01)
    end = time.monotonic()
    deadline = end + 120
    for c in clients:   # drain what is still running (not counted)
        while any(log.done_at is None for log in c.logs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
    warm = start + min(5.0, duration / 4)
    counted = [log for log in done if log.sent_at >= warm and log.done_at and log.done_at <= end]
    span = end - warm
    ttfts = [log.ttft for log in counted if log.ttft is not None]
    speeds = [v for log in counted for v in [log.decode_tokens_per_s()] if v is not None]
    out_tokens = sum(k for log in counted for _, k in log.events)
    errors = sum(len(c.errors) for c in clients)
    return {
        "requests": len(counted), "errors": errors,
        "requests_per_s": round(len(counted) / span, 3),
        "prefill_tokens_per_s": round(len(counted) * prompt_tokens / span, 1),
        "output_tokens_per_s": round(out_tokens / span, 1),
        "ttft_ms_p50": _ms(percentile(ttfts, 50)), "ttft_ms_p90": _ms(percentile(ttfts, 90)),
        "decode_tok_s_median": round(statistics.median(speeds), 1) if speeds else None,
    }


def _ms(x):
    return None if x is None else round(x * 1000, 1)
