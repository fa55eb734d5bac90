"""How kv_transfer hands a prefill job (``input_ids`` and the destination descriptor of
the pages it just reserved) to the prefill side — this server's ``prefill`` model, or
the prefill servers of ``--prefill-endpoints`` (:class:`~.prefill_router.PrefillRouter`).

The ``prefill`` model is no step of the ensembles: kv_transfer calls it (Triton's BLS,
in-process) and it acks at once. So a prefill process that dies or restarts takes no
ensemble down with it: its job fails here, fast ("not healthy", "unknown model"), and
kv_transfer gives the reservation back and routes the prompt to decode's own prefill
(``prefill_down``) until the prefill side is worth another try. One that hangs (SIGSTOP)
costs the job that found it :data:`~.prefill_router.ACK_TIMEOUT_S`, then the same.

>>> side = prefill_side_for(settings, on_down=lambda until: None)     # doctest: +SKIP
>>> side.submit(input_ids, kv_descriptor, cache_salt)                  # doctest: +SKIP
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable

import numpy as np

from .disagg_common import CACHE_SALT, INPUT_IDS, KV_DESCRIPTOR, LORA_NAME, PREFILL_ACK
from .prefill_router import (ACK_TIMEOUT_S, LOCAL_WHILE_DOWN_S, PREFILL_MODEL, EndpointHealth, PrefillRouter,
                             PrefillUnavailable, parse_endpoints)
from .settings import EngineSettings


class LocalPrefill:
    """Hands jobs to this server's ``prefill`` model over BLS, with
    :class:`PrefillRouter`'s contract: ``submit`` returns when the job was taken, raises
    :class:`PrefillUnavailable` when the model could not take it (``on_down(until)``
    told when it is worth another try; ``on_down(None)`` when it takes jobs again) and
    ``ValueError`` when it refused the job itself."""

    def __init__(self, model: str = PREFILL_MODEL, timeout_s: float = ACK_TIMEOUT_S,
                 on_down: Callable[[float | None], None] | None = None):
        self.model, self.timeout_s = model, timeout_s
        self._on_down = on_down or (lambda until: None)
        self._health = EndpointHealth()
        self._lock = threading.Lock()
        # an exec that hangs (a stopped stub) holds its thread until the stub resumes
        self._calls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="tandem-prefill-bls")

    def submit(self, input_ids: np.ndarray, kv_descriptor: np.ndarray,
               cache_salt: str | None = None, lora_name: str | None = None) -> str:
        import triton_python_backend_utils as pb_utils

        now = time.monotonic()
        with self._lock:
            down = self._health.down_for(now)
        if down:
            raise PrefillUnavailable(f"unavailable: the prefill model is skipped for {down:.1f} s more "
                                     f"({self._health.last_error}); retry", tried=False)
        inputs = [pb_utils.Tensor(INPUT_IDS, np.asarray(input_ids, dtype=np.int32).reshape(1, -1)),
                  pb_utils.Tensor(KV_DESCRIPTOR, np.asarray(kv_descriptor, dtype=np.uint8).reshape(1, -1))]
        if cache_salt is not None:
            inputs.append(pb_utils.Tensor(CACHE_SALT, np.array([[cache_salt.encode()]], dtype=object)))
        if lora_name is not None:
            inputs.append(pb_utils.Tensor(LORA_NAME, np.array([[lora_name.encode()]], dtype=object)))
        request = pb_utils.InferenceRequest(model_name=self.model, inputs=inputs,
                                            requested_output_names=[PREFILL_ACK])
        call = self._calls.submit(request.exec)
        try:
            response = call.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._failed(f"no ack within {self.timeout_s:g} s", hung=True) from None
        except Exception as e:   # noqa: BLE001 - the call itself failed: the model is not there
            raise self._failed(str(e), hung=False) from None
        if response.has_error():
            error = response.error()
            if error.code() == pb_utils.TritonError.INVALID_ARG:
                raise ValueError(error.message())             # the job itself is wrong for this prefill
            raise self._failed(error.message(), hung=False)  # dead, reloading, shutting down
        with self._lock:
            was_down = self._health.until > 0
            self._health.succeeded()
        if was_down:
            self._on_down(None)
        return self.model

    def _failed(self, error: str, hung: bool) -> PrefillUnavailable:
        """Mark the model down (tell ``on_down``) and return the error to raise."""
        now = time.monotonic()
        with self._lock:
            self._health.failed(hung, now, error)
            until = max(self._health.until, now + LOCAL_WHILE_DOWN_S)
        self._on_down(until)
        return PrefillUnavailable(f"unavailable: the prefill model took no job: {error}; retry")

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)


def prefill_side_for(s: EngineSettings, on_down: Callable[[float | None], None]):
    """The prefill side of a decode server with settings ``s``: its own ``prefill``
    model, or with ``prefill_endpoints`` the prefill servers (cache-aware or round
    robin, ``prefill_routing``)."""
    if not s.prefill_endpoints:
        return LocalPrefill(on_down=on_down)
    from tandem.backends.disagg.prefix_affinity import AffinityPolicy

    # the prefix index counts in this server's pages (its descriptors'); a backlog drains
    # as fast as conditional routing assumes the prefill side works
    affinity = AffinityPolicy(page_size=s.page_size, tokens_per_s=s.routing_policy().prefill_tokens_per_s)
    return PrefillRouter(parse_endpoints(s.prefill_endpoints), on_down=on_down,
                         routing=s.prefill_routing, affinity=affinity)
