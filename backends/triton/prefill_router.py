"""Remote prefill: a decode server hands its prefill jobs to prefill servers.

With ``--prefill-endpoints`` the decode server's own ``prefill`` model computes
nothing; it forwards each job (``input_ids`` and the destination descriptor that
kv_transfer returned) to the ``prefill`` model of a prefill server over Triton's
gRPC API, and that server streams the KV over UCX straight into the decode server's
reserved pages (the descriptor carries the receiver's worker address). One prefill
server can so feed several decode servers; a decode server spreads its jobs over its
endpoints round robin, skipping one that fails.

>>> r = PrefillRouter(["10.0.0.5:8001", "10.0.0.6:8001"])    # doctest: +SKIP
>>> r.submit(input_ids, kv_descriptor)                         # doctest: +SKIP
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from .disagg_common import INPUT_IDS, KV_DESCRIPTOR

PREFILL_MODEL = "prefill"


class PrefillUnavailable(RuntimeError):
    """No prefill endpoint accepted the job; the message lists each endpoint's error."""


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
    def __init__(self, endpoints: list[str], timeout_s: float = 30.0, model: str = PREFILL_MODEL):
        if not endpoints:
            raise ValueError("prefill_endpoints: at least one host:port is needed")
        self.endpoints, self.timeout_s, self.model = list(endpoints), timeout_s, model
        self._clients: dict[str, object] = {}
        self._next = itertools.cycle(range(len(self.endpoints)))
        self._lock = threading.Lock()

    def _client(self, url: str):
        import tritonclient.grpc as grpcclient
        with self._lock:
            c = self._clients.get(url)
            if c is None:
                c = self._clients[url] = grpcclient.InferenceServerClient(url)
            return c

    def submit(self, input_ids: np.ndarray, kv_descriptor: np.ndarray) -> str:
        """Hand one job to a prefill server; returns the endpoint that took it."""
        import tritonclient.grpc as grpcclient
        ids = np.asarray(input_ids, dtype=np.int32).reshape(1, -1)
        desc = np.asarray(kv_descriptor, dtype=np.uint8).reshape(1, -1)
        inputs = [grpcclient.InferInput(INPUT_IDS, list(ids.shape), "INT32"),
                  grpcclient.InferInput(KV_DESCRIPTOR, list(desc.shape), "UINT8")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(desc)
        with self._lock:
            start = next(self._next)
        errors = []
        for i in range(len(self.endpoints)):
            url = self.endpoints[(start + i) % len(self.endpoints)]
            try:
                self._client(url).infer(self.model, inputs, client_timeout=self.timeout_s)
                return url
            except Exception as e:   # unreachable, or the prefill server refused the job
                errors.append(f"{url}: {e.message() if hasattr(e, 'message') else e}")
        raise PrefillUnavailable("no prefill server took the job: " + "; ".join(errors))

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                try:
                    c.close()
                except Exception:
                    pass
            self._clients.clear()
