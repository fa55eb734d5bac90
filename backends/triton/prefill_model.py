"""The ``prefill`` model: chunked prefill of ``input_ids[:-1]`` in its own process,
streaming each layer's KV into the decoder's reservation.

``execute`` hands each job to the :class:`~tandem.backends.disagg.PrefillService`
and answers at once (``prefill_ack``): the decoder learns that the KV arrived from
its reservation's counter, not from this model.

With the ``prefill_endpoints`` parameter (``tandem serve --prefill-endpoints``) this
model computes nothing: it forwards each job to the ``prefill`` model of a prefill
server (``tandem serve --mode prefill``), which streams the KV over UCX straight into
this server's reserved pages (:class:`~tandem.backends.triton.prefill_router.PrefillRouter`).

A descriptor is hostile until checked: it is parsed within fixed limits (no plan is
built) and held against this prefill's own pools before the job is accepted; a
forged one is refused with INVALID_ARG, and one that names another request's
reservation without its secret is refused by the receiver, which ends only that
transfer (and with it this prefill).
"""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from .disagg_common import INPUT_IDS, KV_DESCRIPTOR, NO_TRANSFER, PREFILL_ACK, token_ids
from .per_request import PerRequestModel, error_response
from .settings import EngineSettings


class TritonPythonModel(PerRequestModel):
    def initialize(self, args: dict) -> None:
        s = EngineSettings.from_model_config(json.loads(args["model_config"]))
        self.service = self.router = None
        if s.prefill_endpoints:
            from tandem.backends.triton.prefill_router import PrefillRouter, parse_endpoints
            self.load_board = None   # decode's board, opened once decode has made it
            self.router = PrefillRouter(parse_endpoints(s.prefill_endpoints), on_down=self._prefill_down)
            pb_utils.Logger.log_info(f"[prefill] forwarding to {', '.join(self.router.endpoints)}")
            return
        import torch

        from tandem.backends.disagg import PrefillService
        from tandem.rdma import SenderConfig

        torch.set_num_threads(s.threads)
        # num_pages sizes the decode pool; the prefill's own pool takes the default.
        # With speculation the prefill fills the proposer's KV too (the decoder expects it)
        sender = SenderConfig(timeout_s=float(s.kv_transfer_timeout_s) + 5.0,
                              net_devices=s.net_devices, transports=s.transports,
                              faults=s.fault_plan())
        self.service = PrefillService(s.engine_config(num_pages=None), sender)
        self.drain_s = sender.timeout_s   # a transfer that makes no progress fails by then
        self.service.start()
        if sender.faults is not None:
            pb_utils.Logger.log_warn(f"[prefill] fault injection is on: {sender.faults}")

    def respond(self, request):
        from tandem.rdma import DestinationDescriptor
        from tandem.rdma.wire import MalformedMessage

        desc_arr = pb_utils.get_input_tensor_by_name(request, KV_DESCRIPTOR).as_numpy()
        ids_arr = pb_utils.get_input_tensor_by_name(request, INPUT_IDS).as_numpy()
        desc = desc_arr.tobytes()
        if desc != NO_TRANSFER:
            try:
                d = DestinationDescriptor.from_bytes(desc)   # bounded: refused before any plan
                if self.router is not None:
                    self.router.submit(ids_arr, desc_arr)
                else:
                    self.service.submit(d, token_ids(ids_arr), _log_failure)
            except (MalformedMessage, ValueError) as e:
                return error_response(
                    f"kv_descriptor: {e}", pb_utils.TritonError.INVALID_ARG)
            except RuntimeError as e:   # PrefillUnavailable (every prefill server failed), PrefillClosing
                return error_response(
                    str(e), pb_utils.TritonError.UNAVAILABLE)
        ack = np.ones((1, 1), dtype=bool)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(PREFILL_ACK, ack)])

    def _prefill_down(self, until_s: float | None) -> None:
        """Tell kv_transfer (decode's load board) that the prefill servers took no job:
        conditional routing then prefills long prompts in decode until ``until_s``."""
        from tandem.backends.disagg import server_pool_name
        from tandem.backends.disagg.decode_load import DecodeLoadBoard

        if self.load_board is None:
            self.load_board = DecodeLoadBoard.open_if_exists(server_pool_name())
        if self.load_board is not None:
            self.load_board.prefill_down_until(0 if until_s is None else int(until_s * 1e9))

    def finalize(self) -> None:
        if getattr(self, "service", None) is not None:
            # an unload (a draining server, a version roll): the jobs taken finish first
            self.service.shutdown(drain_s=self.drain_s)
        if getattr(self, "router", None) is not None:
            self.router.close()


def _log_failure(error: str | None) -> None:
    if error is not None:
        pb_utils.Logger.log_warn(f"[prefill] KV transfer failed: {error}")
