"""The frontend's own Prometheus metrics, on its ``/metrics`` (Triton's metrics port
carries the engine's): requests and errors by endpoint and HTTP status, request latency
(to the last byte, streams included), time to the first token, tokens in and out.

An ASGI middleware (:class:`MetricsMiddleware`) sees every ``/v1`` request's status
and its last byte, so a streamed response is timed to its end, not to its headers.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class FrontendMetrics:
    """One registry per app (two frontends in one process do not share series)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tandem_openai_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("tandem_openai_errors", "requests that failed: an HTTP error status, or an "
                              "error event in a stream that had started (status 'stream')",
                              ["endpoint", "status"], registry=r)
        self.in_progress = Gauge("tandem_openai_requests_in_progress", "requests being served",
                                 ["endpoint"], registry=r)
        self.latency = Histogram("tandem_openai_request_seconds", "request received to last byte sent",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tandem_openai_time_to_first_token_seconds",
                              "request received to the first generated text sent (streamed requests)",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem_openai_prompt_tokens", "prompt tokens of finished choices",
                                     ["endpoint"], registry=r)
        self.completion_tokens = Counter("tandem_openai_completion_tokens", "tokens generated",
                                         ["endpoint"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
OTHER = "other"   # every path the API does not serve: one label, whatever a client sends


def endpoint_of(path: str) -> str:
    """The label of a path: ``/v1/models/x`` counts as ``/v1/models``; a path the API does
    not serve counts as ``other`` (a label per path would let any client grow the series
    without bound).

    >>> endpoint_of("/v1/models/tandem"), endpoint_of("/v1/completions"), endpoint_of("/v1/x123")
    ('/v1/models', '/v1/completions', 'other')
    """
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in ENDPOINTS else OTHER


class MetricsMiddleware:
    """Counts and times every ``/v1`` request (pure ASGI: it sees the stream's end)."""

    def __init__(self, app, metrics: FrontendMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        endpoint, t0, status = endpoint_of(scope["path"]), time.perf_counter(), [500]

        async def send_and_watch(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        m = self.metrics
        m.in_progress.labels(endpoint).inc()
        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            m.in_progress.labels(endpoint).dec()
            m.requests.labels(endpoint, str(status[0])).inc()
            if status[0] >= 400:
                m.errors.labels(endpoint, str(status[0])).inc()
            m.latency.labels(endpoint).observe(time.perf_counter() - t0)
