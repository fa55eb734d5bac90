"""Tandem's custom metrics on Triton's metrics port, through the Python backend's
``MetricFamily`` API. Every metric carries the labels ``model``, ``version`` and
``incarnation`` (the stub's pid): while a model reloads, its old and new instance both
live, and Triton hands two instances with equal labels the *same* metric object,
counted per instance — the old one's ``finalize`` then frees what the new one still
writes (a corrupted server heap: glibc aborts the server). Sum over ``incarnation``.

Engine models (``llm``, ``decode``):

=============================================  =========  =============================================
tandem_time_to_first_token_seconds             histogram  request received by the model -> first token
tandem_inter_token_latency_seconds             histogram  between token-carrying responses of a stream
tandem_prompt_tokens_total                     counter    prompt tokens of finished requests
tandem_generation_tokens_total                 counter    tokens generated
tandem_requests_in_engine                      gauge      submitted and not yet finished
tandem_requests_finished_total{reason}         counter    stop, length, abort, error, rejected
tandem_spec_drafts_total                       counter    verification rounds (one per sequence and step)
tandem_spec_draft_tokens_total                 counter    draft tokens proposed
tandem_spec_accepted_tokens_total              counter    draft tokens accepted
tandem_spec_acceptance_rate                    gauge      accepted / draft tokens, since start
tandem_spec_mean_acceptance_length             gauge      1 + accepted / drafts, since start
tandem_spec_steps_total{k, reason}             counter    decode steps by the drafts per sequence chosen (0:
                                                          plain) and why (backends/speculative/adaptive.py)
tandem_spec_method_draft_tokens_total{method}  counter    draft tokens by the proposer that drafted them
tandem_spec_method_accepted_tokens_total{method} counter  accepted draft tokens, by proposer
tandem_kv_pages{state}                         gauge      free, reserved, in_use
tandem_kv_reservations_reclaimed_total         counter    reservations failed or reclaimed (shared pool)
tandem_kv_transfer_failures_total{reason}      counter    requests whose KV never arrived, by reason
tandem_kv_transfer_recomputed_total            counter    ... of which decode prefilled the prompt itself
tandem_engine_dtype_info{dtype}                gauge      1: the dtype the engine runs (``--dtype auto``
                                                          picks it per CPU)
=============================================  =========  =============================================

``kv_transfer``: ``tandem_kv_received_bytes_total``, ``tandem_kv_reservations_total``,
``tandem_kv_transfer_seconds`` (histogram: reservation -> all KV arrived), and
``tandem_disagg_requests_total{path, reason}`` (counter: where each prompt was prefilled
— ``local`` in decode or ``remote`` on the prefill side — and why; reasons in
``tandem.backends.disagg.routing``).

Polled values (engine counters, pool pages) are refreshed by a :class:`Poller` thread;
per-request values are recorded as they happen. Every update of one model's metrics
goes through one lock: the Python backend's ``Metric.increment`` releases the GIL and
rewrites the metric's shared-memory message, and two threads updating one metric at
once made the server read a freed message (SIGSEGV in ``triton::core::Metric``).
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import triton_python_backend_utils as pb_utils

from .latency import Deltas, StreamClock

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
TRANSFER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")
PAGE_STATES = ("free", "reserved", "in_use")


def _kind(name: str):
    # read at use: the stub attaches MetricFamily to pb_utils after our modules import
    return getattr(pb_utils.MetricFamily, name.upper())


class _Locked:
    """A metric whose updates hold the model's metrics lock; after the registry closed
    (the model finalizes) updates do nothing."""

    __slots__ = ("_m", "_lock")

    def __init__(self, metric, lock: threading.Lock):
        self._m, self._lock = metric, lock

    def increment(self, value: float) -> None:
        if value:
            with self._lock:
                if self._m is not None:
                    self._m.increment(value)

    def set(self, value: float) -> None:
        with self._lock:
            if self._m is not None:
                self._m.set(value)

    def observe(self, value: float) -> None:
        with self._lock:
            if self._m is not None:
                self._m.observe(value)


class _Registry:
    """Families and their metrics, created once; the families must stay referenced
    for their metrics to live, and both must be dropped (:meth:`close`) while the
    stub can still talk to the server."""

    def __init__(self, model: str, version: str):
        # not "instance": Prometheus sets its own at scrape time
        self.labels = {"model": model, "version": version, "incarnation": str(os.getpid())}
        self._families: dict[str, object] = {}
        self._metrics: dict[tuple, _Locked] = {}
        self._lock = threading.Lock()

    def metric(self, name: str, kind: str, description: str, buckets=None, **labels) -> _Locked:
        key = (name, tuple(sorted(labels.items())))
        m = self._metrics.get(key)
        if m is not None:
            return m
        with self._lock:   # created from several threads (request path, poller)
            m = self._metrics.get(key)
            if m is None:
                family = self._families.get(name)
                if family is None:
                    family = self._families[name] = pb_utils.MetricFamily(
                        name=name, description=description, kind=_kind(kind))
                all_labels = {**self.labels, **labels}
                raw = family.Metric(labels=all_labels, buckets=buckets) if buckets is not None \
                    else family.Metric(labels=all_labels)
                m = self._metrics[key] = _Locked(raw, self._lock)
        return m

    def close(self) -> None:
        """Drop every metric and family now, whoever still holds a wrapper: left to
        interpreter teardown they are destroyed after the stub's IPC is gone and crash it."""
        import gc
        with self._lock:
            for m in self._metrics.values():
                m._m = None
            self._metrics.clear()
            self._families.clear()
        gc.collect()


def _set_pages(r: _Registry, pages: dict[str, int]) -> None:
    for state in PAGE_STATES:
        r.metric("tandem_kv_pages", "gauge", "KV cache pages by state", state=state).set(pages[state])


class _ModelMetrics:
    """One model version's metrics, labelled with its name and version."""

    def __init__(self, model: str, version: str):
        self._r = _Registry(model, version)

    def close(self) -> None:
        self._r.close()


class EngineMetrics(_ModelMetrics):
    """What the ``llm`` and ``decode`` models record about requests and the engine."""

    def __init__(self, model: str, version: str, dtype: str = ""):
        super().__init__(model, version)
        r = self._r
        if dtype:
            r.metric("tandem_engine_dtype_info", "gauge", "1: the dtype the engine's weights and KV run in",
                     dtype=dtype).set(1)
        self.ttft = r.metric("tandem_time_to_first_token_seconds", "histogram",
                             "time from the model receiving a request to its first token",
                             TTFT_BUCKETS)
        self.itl = r.metric("tandem_inter_token_latency_seconds", "histogram",
                            "time between consecutive token-carrying responses of a stream",
                            ITL_BUCKETS)
        self.prompt_tokens = r.metric("tandem_prompt_tokens_total", "counter",
                                      "prompt tokens of finished requests")
        self.generation_tokens = r.metric("tandem_generation_tokens_total", "counter",
                                          "tokens generated")
        self.in_engine = r.metric("tandem_requests_in_engine", "gauge",
                                  "requests submitted to the engine and not yet finished by it")
        self.finished = {reason: r.metric("tandem_requests_finished_total", "counter",
                                          "requests ended, by finish reason (rejected: invalid "
                                          "input)", reason=reason)
                         for reason in FINISH_REASONS}
        self._deltas = Deltas()

    # -- per request (any thread) -------------------------------------------------------
    def submitted(self) -> StreamClock:
        self.in_engine.increment(1)
        return StreamClock()

    def not_submitted(self) -> None:
        self.in_engine.increment(-1)

    def output(self, clock: StreamClock, out) -> None:
        """One engine ``RequestOutput`` of a stream."""
        n = len(out.new_token_ids)
        ttft, itl = clock.tokens(n)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)
        if n:
            self.generation_tokens.increment(n)
        if out.finished:
            self.in_engine.increment(-1)
            self.prompt_tokens.increment(out.num_prompt_tokens)
            self.finish(out.finish_reason or "stop")

    def finish(self, reason: str) -> None:
        metric = self.finished.get(reason)
        if metric is not None:
            metric.increment(1)

    # -- polled (the poller thread) -----------------------------------------------------
    def poll_engine(self, engine, pool=None, failures: dict | None = None, recomputed: int = 0) -> None:
        """Refresh from an ``AsyncEngine`` (its speculation counters and pages) and, on
        the disaggregated path, the shared pool, the transfer failures by reason and how
        many of them decode recomputed."""
        r, d = self._r, self._deltas
        m = engine.spec_metrics
        if m is not None:
            for name, total, what in (
                    ("tandem_spec_drafts_total", m.num_drafts, "verification rounds"),
                    ("tandem_spec_draft_tokens_total", m.num_draft_tokens, "draft tokens proposed"),
                    ("tandem_spec_accepted_tokens_total", m.num_accepted_tokens,
                     "draft tokens accepted")):
                r.metric(name, "counter", what).increment(d.take(name, total))
            r.metric("tandem_spec_acceptance_rate", "gauge",
                     "accepted / proposed draft tokens since start").set(m.acceptance_rate)
            r.metric("tandem_spec_mean_acceptance_length", "gauge",
                     "1 + accepted draft tokens / verification rounds since start"
                     ).set(m.mean_acceptance_length)
            for (k, reason), total in list(m.steps_by_choice.items()):
                r.metric("tandem_spec_steps_total", "counter",
                         "decode steps by the draft tokens per sequence chosen (0: a plain step) and why",
                         k=str(k), reason=reason).increment(d.take(("steps", k, reason), total))
            for method, (_, drafted, accepted) in list(m.by_method.items()):
                r.metric("tandem_spec_method_draft_tokens_total", "counter",
                         "draft tokens proposed, by proposer", method=method
                         ).increment(d.take(("drafted", method), drafted))
                r.metric("tandem_spec_method_accepted_tokens_total", "counter",
                         "draft tokens accepted, by proposer", method=method
                         ).increment(d.take(("accepted", method), accepted))
        c = getattr(engine, "prefix_cache", None)
        if c is not None:
            _prefix_cache(r, d, c)
        lora = getattr(engine, "lora", None)
        if lora is not None:
            _lora(r, d, lora)
        if pool is not None:
            s = pool.stats()
            pages = {"free": s.free, "reserved": s.reserved, "in_use": s.in_use}
            reclaimed = r.metric("tandem_kv_reservations_reclaimed_total", "counter",
                                 "reservations failed or reclaimed in the shared KV pool")
            reclaimed.increment(d.take("reclaimed", s.failed_reservations + s.reclaimed_owners))
        else:
            free, used = engine.kv_pages
            pages = {"free": free, "reserved": 0, "in_use": used}
        _set_pages(r, pages)
        for reason, total in (failures or {}).items():
            r.metric("tandem_kv_transfer_failures_total", "counter",
                     "requests whose prompt KV never arrived, by reason",
                     reason=reason).increment(d.take(("failure", reason), total))
        if pool is not None:
            r.metric("tandem_kv_transfer_recomputed_total", "counter",
                     "requests whose prompt KV transfer failed and decode prefilled them itself"
                     ).increment(d.take("recomputed", recomputed))


def _lora(r, d, stats) -> None:
    """The engine's LoRA adapter slots (a ``backends.lora.LoRAStats``)."""
    r.metric("tandem_lora_adapters_loaded", "gauge", "LoRA adapters in the engine's slots").set(len(stats.loaded))
    r.metric("tandem_lora_slots", "gauge", "the engine's LoRA adapter slots (--max-loras)").set(stats.max_loras)
    for name, total in (("tandem_lora_loads_total", stats.loads), ("tandem_lora_evictions_total", stats.evictions)):
        what = "adapters loaded into a slot" if "loads" in name else "idle adapters evicted for another"
        r.metric(name, "counter", what).increment(d.take(name, total))
    for adapter, total in stats.requests.items():
        r.metric("tandem_lora_requests_total", "counter", "requests run under each LoRA adapter",
                 adapter=adapter).increment(d.take(("lora", adapter), total))


class TransferMetrics(_ModelMetrics):
    """What the ``kv_transfer`` model records: bytes, reservations, transfer time."""

    def __init__(self, model: str, version: str):
        super().__init__(model, version)
        self.seconds = self._r.metric(
            "tandem_kv_transfer_seconds", "histogram",
            "time from reserving decode pages to the last KV byte arriving", TRANSFER_BUCKETS)
        self._deltas = Deltas()

    def routed(self, path: str, reason: str) -> None:
        """One request's prefill placed (``tandem.backends.disagg.routing.choose_path``)."""
        self._r.metric("tandem_disagg_requests_total", "counter",
                       "requests by where their prompt was prefilled (local: in decode; remote: "
                       "on the prefill side) and the reason", path=path, reason=reason).increment(1)

    def on_ready(self, trace) -> None:   # the receiver's transport thread
        if trace.ready_at is not None:
            self.seconds.observe(trace.ready_at - trace.reserved_at)

    def poll_receiver(self, stats, pool) -> None:
        r, d = self._r, self._deltas
        r.metric("tandem_kv_received_bytes_total", "counter", "KV bytes received over UCX"
                 ).increment(d.take("bytes", stats.bytes_received))
        r.metric("tandem_kv_reservations_total", "counter", "decode page reservations made"
                 ).increment(d.take("reservations", stats.reservations))
        s = pool.stats()
        _set_pages(r, {"free": s.free, "reserved": s.reserved, "in_use": s.in_use})


def _prefix_cache(r: _Registry, d: Deltas, c) -> None:
    """A ``PrefixCacheStats``: vLLM's prefix_cache_queries / prefix_cache_hits, in tokens."""
    for name, total, what in (
            ("tandem_prefix_cache_queries_total", c.queried_tokens,
             "prompt tokens looked up in the prefix cache (full pages, the last token excluded)"),
            ("tandem_prefix_cache_hits_total", c.hit_tokens, "prompt tokens the prefix cache served"),
            ("tandem_prefix_cache_evictions_total", c.evictions, "cached KV pages evicted for new ones"),
            ("tandem_prefix_cache_audited_pages_total", c.audited_pages,
             "cached pages of hits whose checksum was recomputed (--kv-audit)"),
            ("tandem_prefix_cache_corrupt_pages_total", c.corrupt_pages,
             "cached pages found changed since publication: dropped and recomputed, never served"),
            ("tandem_prefix_cache_recompared_pages_total", c.recompared_pages,
             "pages of hits declined and recomputed, compared with the cached page (--kv-audit-recompute)"),
            ("tandem_prefix_cache_disagreeing_pages_total", c.disagreeing_pages,
             "cached pages whose recomputation held other KV: dropped, never served again")):
        r.metric(name, "counter", what).increment(d.take(name, total))
    r.metric("tandem_prefix_cache_hit_rate", "gauge",
             "prefix cache hits / queries (tokens) since start").set(c.hit_rate)
    r.metric("tandem_prefix_cache_pages", "gauge", "KV pages the prefix cache holds").set(c.cached_pages)


class PrefillMetrics(_ModelMetrics):
    """What the ``prefill`` model (its local role) records: its own prefix cache."""

    def __init__(self, model: str, version: str):
        super().__init__(model, version)
        self._deltas = Deltas()

    def poll_prefill(self, prefix_cache) -> None:
        """Refresh from the prefill engine's ``PrefixCacheStats`` (None: caching off)."""
        if prefix_cache is not None:
            _prefix_cache(self._r, self._deltas, prefix_cache)


class Poller:
    """Calls ``fn`` every ``interval_s`` on its own thread until :meth:`stop`."""

    def __init__(self, fn: Callable[[], None], interval_s: float = 0.5, name: str = "tandem-metrics"):
        self._fn, self._interval = fn, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._fn()
            except Exception as exc:   # a metric must never take the model down
                pb_utils.Logger.log_warn(f"[tandem] metrics poll failed: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
