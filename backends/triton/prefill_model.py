"""The ``prefill`` model: each job (``input_ids`` and the destination descriptor that
kv_transfer returned) is taken at once and acked (``prefill_ack``): the decoder learns
that the KV arrived from its reservation's counter, not from this model.

It has one of two roles, fixed by its config (:func:`prefill_model_for` picks):

- :class:`~.prefill_local.LocalPrefillModel` — chunked prefill of ``input_ids[:-1]``
  in this process, streaming each layer's KV into the decoder's reservation;
- :class:`~.prefill_remote.RemotePrefillModel` — with the ``prefill_endpoints``
  parameter (``tandem serve --prefill-endpoints``) it computes nothing and forwards
  each job to the ``prefill`` model of a prefill server (``tandem serve --mode
  prefill``), which streams the KV over UCX straight into this server's pages.

A descriptor is hostile until checked: it is parsed within fixed limits (no plan is
built) before either role sees it, and the local role holds it against its own pools
before the job is accepted; a forged one is refused with INVALID_ARG, and one that
names another request's reservation without its secret is refused by the receiver,
which ends only that transfer (and with it this prefill).
"""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from .disagg_common import CACHE_SALT, INPUT_IDS, KV_DESCRIPTOR, NO_TRANSFER, PREFILL_ACK
from .per_request import PerRequestModel, error_response
from .settings import EngineSettings


def prefill_model_for(args: dict) -> "PrefillModel":
    """The role the model's config asks for (not yet initialized)."""
    s = EngineSettings.from_model_config(json.loads(args["model_config"]))
    if s.prefill_endpoints:
        from .prefill_remote import RemotePrefillModel
        return RemotePrefillModel()
    # imported only here: the remote role loads neither torch nor the engine
    from .prefill_local import LocalPrefillModel
    return LocalPrefillModel()


class PrefillModel(PerRequestModel):
    """What both roles share: the inputs read, the descriptor parsed (bounded) and the
    answer — an ack, or the job's refusal as a Triton error."""

    def take(self, desc, desc_arr: np.ndarray, ids_arr: np.ndarray,
             cache_salt: str | None = None) -> None:
        """Accept one job for the parsed ``desc`` (raw: ``desc_arr``), its prompt's
        prefix-cache salt ``cache_salt``; raise ValueError for a job that is wrong,
        RuntimeError for one this side cannot serve now."""
        raise NotImplementedError

    def respond(self, request):
        from tandem.rdma import DestinationDescriptor
        from tandem.rdma.wire import MalformedMessage

        desc_arr = pb_utils.get_input_tensor_by_name(request, KV_DESCRIPTOR).as_numpy()
        ids_arr = pb_utils.get_input_tensor_by_name(request, INPUT_IDS).as_numpy()
        desc = desc_arr.tobytes()
        if desc != NO_TRANSFER:
            try:
                d = DestinationDescriptor.from_bytes(desc)   # bounded: refused before any plan
                self.take(d, desc_arr, ids_arr, _cache_salt(request))
            except (MalformedMessage, ValueError) as e:
                return error_response(
                    f"kv_descriptor: {e}", pb_utils.TritonError.INVALID_ARG)
            except RuntimeError as e:   # PrefillUnavailable (every prefill server failed), PrefillClosing
                return error_response(
                    str(e), pb_utils.TritonError.UNAVAILABLE)
        ack = np.ones((1, 1), dtype=bool)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(PREFILL_ACK, ack)])

    def finalize(self) -> None:
        pass


def _cache_salt(request) -> str | None:
    """The optional ``cache_salt`` input (checked, as every input, by preprocess/kv_transfer)."""
    t = pb_utils.get_input_tensor_by_name(request, CACHE_SALT)
    if t is None:
        return None
    v = t.as_numpy().reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else str(v)
