"""The ``prefill`` model's local role: a :class:`~tandem.backends.disagg.PrefillService`
in this process prefills each job and streams its KV into the decoder's reservation."""
from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from .disagg_common import token_ids
from .metrics import Poller, PrefillMetrics
from .prefill_base import PrefillModel
from .settings import EngineSettings


class LocalPrefillModel(PrefillModel):
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
        self.service = PrefillService(s.engine_config(num_pages=None, model_version=version),
                                      sender)
        self.drain_s = sender.timeout_s   # a transfer that makes no progress fails by then
        self.service.before_step = PrefillThreads(server_pool_name(), s.threads,
                                                  s.prefill_idle_threads_or_threads)
        self.service.start()
        self.metrics = PrefillMetrics(args.get("model_name", "prefill"), version)
        self.metrics_poller = Poller(
            lambda: self.metrics.poll_prefill(self.service.engine.prefix_cache_stats()))
        if sender.faults is not None:
            pb_utils.Logger.log_warn(f"[prefill] fault injection is on: {sender.faults}")

    def take(self, desc, desc_arr, ids_arr, cache_salt=None) -> None:
        # raises ValueError (a descriptor that does not fit this prefill's pools) or
        # PrefillClosing (shutting down)
        self.service.submit(desc, token_ids(ids_arr), _log_failure, cache_salt=cache_salt)

    def finalize(self) -> None:
        if getattr(self, "metrics_poller", None) is not None:
            self.metrics_poller.stop()
        if getattr(self, "service", None) is not None:
            # an unload (a draining server, a version roll): the jobs taken finish first
            self.service.shutdown(drain_s=self.drain_s)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()   # while the stub can still talk to the server
            self.metrics = None


def _log_failure(error: str | None) -> None:
    if error is not None:
        pb_utils.Logger.log_warn(f"[prefill] KV transfer failed: {error}")
