"""Remote prefill: a decode server hands its prefill jobs to prefill servers.

With ``--prefill-endpoints`` the decode server's own ``prefill`` model computes
nothing; it forwards each job (``input_ids`` and the destination descriptor that
kv_transfer returned) to the ``prefill`` model of a prefill server over Triton's
gRPC API, and that server streams the KV over UCX straight into the decode server's
reserved pages (the descriptor carries the receiver's worker address). One prefill
server can so feed several decode servers. A decode server sends each job to the
endpoint whose prefix cache likely holds the longest prefix of the prompt, balanced
against the work it already sent there (``prefill_routing="cache_aware"``, the default:
:mod:`tandem.backends.disagg.prefix_affinity`), or round robin (``"round_robin"``);
the other endpoints are the fallbacks, in that order, and one that fails is skipped.

A prefill server acks a job at once (it only queues it), so a job waits at most
:data:`ACK_TIMEOUT_S` for its ack: this model serves the decode server's local-path
requests too (they pass through it), and a prefill server that hangs must not stall
them for long. An endpoint that fails is then skipped for a while
(:class:`EndpointHealth`): briefly when it refused the connection (a restarted server
is used again within a second, on a fresh channel: gRPC's own reconnect backoff grows
with the outage), longer, doubling, when it timed out (each probe of a hung server
costs one job its ack timeout).

>>> r = PrefillRouter(["10.0.0.5:8001", "10.0.0.6:8001"])    # doctest: +SKIP
>>> r.submit(input_ids, kv_descriptor)                         # doctest: +SKIP
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

import numpy as np

from tandem.backends.disagg.prefix_affinity import (CACHE_AWARE, PREFILL_ROUTINGS, AffinityPolicy,
                                                    PrefixAffinity, prompt_keys, try_order)

from .disagg_common import CACHE_SALT, INPUT_IDS, KV_DESCRIPTOR, LORA_NAME

PREFILL_MODEL = "prefill"
ACK_TIMEOUT_S = 3.0          # a healthy prefill server acks in milliseconds
REFUSED_DOWN_S = 1.0         # skip an endpoint that refused the connection this long
HUNG_DOWN_S = (2.0, 30.0)    # ... one that timed out: from, doubling up to
LOCAL_WHILE_DOWN_S = 5.0     # after no endpoint took a job, decode prefills itself this long


class PrefillUnavailable(RuntimeError):
    """No prefill endpoint accepted the job; the message lists each endpoint's error.
    ``tried``: False when every endpoint was skipped (down), none asked."""

    def __init__(self, message: str, tried: bool = True):
        super().__init__(message)
        self.tried = tried


class EndpointHealth:
    """When one endpoint is worth trying again (pure: the caller passes the time).

    >>> h = EndpointHealth()
    >>> h.failed(hung=True, now=0.0); h.down_for(1.0), h.down_for(2.5)
    (1.0, 0.0)
    >>> h.failed(hung=True, now=3.0); h.down_for(3.0)     # doubled
    4.0
    >>> h.succeeded(); h.failed(hung=False, now=10.0); h.down_for(10.0)
    1.0
    """

    def __init__(self):
        self.until, self.hung_s, self.last_error = 0.0, 0.0, ""

    def down_for(self, now: float) -> float:
        return max(0.0, self.until - now)

    def failed(self, hung: bool, now: float, error: str = "") -> None:
        if hung:
            self.hung_s = min(HUNG_DOWN_S[1], max(HUNG_DOWN_S[0], 2 * self.hung_s))
        self.until = now + (self.hung_s if hung else REFUSED_DOWN_S)
        self.last_error = error

    def succeeded(self) -> None:
        self.until, self.hung_s = 0.0, 0.0


def parse_endpoints(text: str) -> list[str]:
    """``"host:port,host:port"`` -> the list; each must name a host and a port.

    >>> parse_endpoints(" 127.0.0.1:8001, prefill-0:9001 ")
    ['127.0.0.1:8001', 'prefill-0:9001']
    """
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"prefill_endpoints: {item!r} is not host:port (a gRPC endpoint)")
        out.append(item)
    return out


class PrefillRouter:
    def __init__(self, endpoints: list[str], timeout_s: float = ACK_TIMEOUT_S, model: str = PREFILL_MODEL,
                 on_down: Callable[[float | None], None] | None = None, routing: str = CACHE_AWARE,
                 affinity: AffinityPolicy = AffinityPolicy()):
        """``on_down(until)``: called when no endpoint took a job, with the
        ``time.monotonic()`` before which none is worth another try (conditional routing
        prefills in decode meanwhile), and with None when one takes a job again.
        ``routing``: one of :data:`PREFILL_ROUTINGS`; ``affinity``: its weights."""
        if not endpoints:
            raise ValueError("prefill_endpoints: at least one host:port is needed")
        if routing not in PREFILL_ROUTINGS:
            raise ValueError(f"prefill_routing {routing!r}; allowed: {', '.join(PREFILL_ROUTINGS)}")
        self.routing = routing
        self._affinity = PrefixAffinity(len(endpoints), affinity) if routing == CACHE_AWARE else None
        self.endpoints, self.timeout_s, self.model = list(endpoints), timeout_s, model
        self._on_down = on_down or (lambda until: None)
        self._clients: dict[str, object] = {}
        self._health = {url: EndpointHealth() for url in self.endpoints}
        self._next = itertools.cycle(range(len(self.endpoints)))
        self._lock = threading.Lock()

    def _client(self, url: str):
        import tritonclient.grpc as grpcclient
        with self._lock:
            c = self._clients.get(url)
            if c is None:
                c = self._clients[url] = grpcclient.InferenceServerClient(url)
            return c

    def _failed(self, url: str, error: Exception, index: int | None = None) -> str:
        """Mark ``url`` (endpoint ``index``) down, unless the server refused this job
        itself; its channel is dropped, so the next try connects afresh, and what the
        index knew of its cache is forgotten (it may come back restarted, empty)."""
        status = str(error.status()) if hasattr(error, "status") else ""
        text = error.message() if hasattr(error, "message") else str(error)
        if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status or not status:
            with self._lock:
                self._health[url].failed("DEADLINE_EXCEEDED" in status, time.monotonic(), text)
                client = self._clients.pop(url, None)
                if self._affinity is not None and index is not None:
                    self._affinity.forget(index)
            if client is not None:
                try:
                    client.close()
                except Exception:   # noqa: BLE001 - a broken channel closes as it can
                    pass
        return f"{url}: {text}"

    def _order(self, ids: list[int]):
        """The endpoints in the order to try them, and the cache-aware plan behind it."""
        affinity = self._affinity
        keys = prompt_keys(ids, affinity.policy.page_size) if affinity is not None else None   # unlocked
        now = time.monotonic()
        with self._lock:
            start = next(self._next)
            usable = [self._health[url].down_for(now) == 0 for url in self.endpoints]
            if affinity is None:
                return try_order((), (), usable, start, cache_aware=False), None
            placement = affinity.plan(ids, usable, start, now, keys)
            return placement.order, placement

    def submit(self, input_ids: np.ndarray, kv_descriptor: np.ndarray,
               cache_salt: str | None = None, lora_name: str | None = None) -> str:
        """Hand one job (with its prompt's prefix-cache salt and LoRA adapter: the prefill
        server serves one of that name too) to a prefill server; returns the endpoint that
        took it."""
        import tritonclient.grpc as grpcclient
        ids = np.asarray(input_ids, dtype=np.int32).reshape(1, -1)
        desc = np.asarray(kv_descriptor, dtype=np.uint8).reshape(1, -1)
        inputs = [grpcclient.InferInput(INPUT_IDS, list(ids.shape), "INT32"),
                  grpcclient.InferInput(KV_DESCRIPTOR, list(desc.shape), "UINT8")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(desc)
        for name, value in ((CACHE_SALT, cache_salt), (LORA_NAME, lora_name)):
            if value is not None:
                inputs.append(grpcclient.InferInput(name, [1, 1], "BYTES"))
                inputs[-1].set_data_from_numpy(np.array([[value.encode()]], dtype=object))
        order, placement = self._order(ids[0].tolist())
        errors, tried = [], False
        for i in order:
            url = self.endpoints[i]
            with self._lock:
                health = self._health[url]
                down = health.down_for(time.monotonic())
            if down:
                errors.append(f"{url}: skipped for {down:.1f} s more ({health.last_error})")
                continue
            tried = True
            try:
                self._client(url).infer(self.model, inputs, client_timeout=self.timeout_s)
            except Exception as e:   # unreachable, hung, or the prefill server refused the job
                errors.append(self._failed(url, e, i))
                continue
            with self._lock:
                health.succeeded()
                if placement is not None:
                    self._affinity.taken(placement, i, time.monotonic())
            self._on_down(None)
            return url
        now = time.monotonic()
        with self._lock:
            retry_at = min(h.until for h in self._health.values())
        self._on_down(max(retry_at, now + LOCAL_WHILE_DOWN_S))
        # UNAVAILABLE (the model says so): the OpenAI frontend and clients read "retry"
        raise PrefillUnavailable("unavailable: no prefill server took the job: " + "; ".join(errors)
                                 + "; retry", tried)

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                try:
                    c.close()
                except Exception:
                    pass
            self._clients.clear()
