"""The ``prefill`` model: each job (``input_ids`` and the destination descriptor that
kv_transfer reserved) is taken at once and acked (``prefill_ack``); a
:class:`~tandem.backends.disagg.PrefillService` in this process prefills
``input_ids[:-1]`` (chunked) and streams each layer's KV into the decoder's reservation.
The decoder learns that the KV arrived from its reservation's counter, not from this
model.

It is no step of the ensembles: kv_transfer hands it its jobs (BLS,
:mod:`.prefill_handoff`), or, on a prefill server (``tandem serve --mode prefill``),
the kv_transfer of decode servers does over gRPC (:mod:`.prefill_router`). So a prefill
process that dies costs only the prompts it was prefilling (decode prefills those
again, ``kv_load_failure_policy``) and, while it restarts, decode prefills the rest.

A descriptor is hostile until checked (the model is callable by anyone who reaches the
server): it is parsed within fixed limits (no plan is built) and held against this
process's own pools before the job is accepted; a forged one is refused with
INVALID_ARG, and one that names another request's reservation without its secret is
refused by the receiver, which ends only that transfer (and with it this prefill).
"""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from .disagg_common import CACHE_SALT, INPUT_IDS, KV_DESCRIPTOR, LORA_NAME, NO_TRANSFER, PREFILL_ACK, token_ids
from .metrics import Poller, PrefillMetrics
from .per_request import PerRequestModel, error_response
from .settings import EngineSettings
from .stub_exit import exit_stub


class PrefillModel(PerRequestModel):
    def initialize(self, args: dict) -> None:
        import torch

        from tandem.backends.disagg import PrefillService, server_pool_name
        from tandem.backends.disagg.decode_load import PrefillThreads
        from tandem.rdma import SenderConfig

        s = EngineSettings.from_model_config(json.loads(args["model_config"]))
        # the OpenMP team sized on this (the main) thread for the most threads the engine
        # thread will ask for (PrefillThreads sets them there before each step)
        torch.set_num_threads(max(s.threads, s.prefill_idle_threads_or_threads))
        # num_pages sizes the decode pool; the prefill's own pool takes the default.
        # With speculation the prefill fills the proposer's KV too (the decoder expects it)
        sender = SenderConfig(timeout_s=float(s.kv_transfer_timeout_s) + 5.0,
                              net_devices=s.net_devices, transports=s.transports,
                              faults=s.fault_plan())
        # the model version is a key of the prefill's own prefix cache
        version = str(args.get("model_version", "1"))
        self.service = PrefillService(s.engine_config(num_pages=None, model_version=version,
                                                      tensor_parallel_size=s.prefill_tp), sender)
        # a rank died: the engine cannot prefill; the stub exits so the model is reloaded
        self.service.on_fatal = lambda exc: exit_stub("prefill", exc)
        self.drain_s = sender.timeout_s   # a transfer that makes no progress fails by then
        self.adapters = s.adapters()      # the server's LoRA adapter registry (None: no LoRA)
        self.service.before_step = PrefillThreads(server_pool_name(), s.threads,
                                                  s.prefill_idle_threads_or_threads)
        self.service.start()
        self.metrics = PrefillMetrics(args.get("model_name", "prefill"), version)
        self.metrics_poller = Poller(
            lambda: self.metrics.poll_prefill(self.service.engine.prefix_cache_stats()))
        if sender.faults is not None:
            pb_utils.Logger.log_warn(f"[prefill] fault injection is on: {sender.faults}")

    def respond(self, request):
        from tandem.rdma import DestinationDescriptor
        from tandem.rdma.wire import MalformedMessage

        desc = pb_utils.get_input_tensor_by_name(request, KV_DESCRIPTOR).as_numpy().tobytes()
        ids = pb_utils.get_input_tensor_by_name(request, INPUT_IDS).as_numpy()
        if desc != NO_TRANSFER:
            try:
                lora = self._adapter(_text(request, LORA_NAME))
            except ValueError as e:
                return error_response(str(e), pb_utils.TritonError.INVALID_ARG)
            try:
                d = DestinationDescriptor.from_bytes(desc)   # bounded: refused before any plan
                # raises ValueError (a descriptor that does not fit this prefill's pools)
                # or PrefillClosing (shutting down)
                self.service.submit(d, token_ids(ids), _log_failure, cache_salt=_text(request, CACHE_SALT),
                                    lora=lora)
            except (MalformedMessage, ValueError) as e:
                return error_response(f"kv_descriptor: {e}", pb_utils.TritonError.INVALID_ARG)
            except RuntimeError as e:   # PrefillClosing
                return error_response(str(e), pb_utils.TritonError.UNAVAILABLE)
        ack = np.ones((1, 1), dtype=bool)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(PREFILL_ACK, ack)])

    def _adapter(self, name: str | None):
        """The ``LoRARequest`` of adapter ``name`` in this server's registry (a prefill
        server's own: it must serve an adapter of that name too); ValueError otherwise."""
        if name is None:
            return None
        entry = self.adapters.get(name) if self.adapters is not None else None
        if entry is None:
            raise ValueError(f"lora_name: this prefill server serves no LoRA adapter {name!r}")
        from tandem.backends.lora.request import LoRARequest
        return LoRARequest(entry.name, entry.id, entry.path)

    def finalize(self) -> None:
        if getattr(self, "metrics_poller", None) is not None:
            self.metrics_poller.stop()
        if getattr(self, "service", None) is not None:
            # an unload (a draining server, a version roll): the jobs taken finish first
            self.service.shutdown(drain_s=self.drain_s)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()   # while the stub can still talk to the server
            self.metrics = None


def _text(request, name: str) -> str | None:
    """An optional STRING input (``cache_salt``, ``lora_name``; checked, as every input,
    by preprocess/kv_transfer)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    v = t.as_numpy().reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else str(v)


def _log_failure(error: str | None) -> None:
    if error is not None:
        pb_utils.Logger.log_warn(f"[prefill] KV transfer failed: {error}")
