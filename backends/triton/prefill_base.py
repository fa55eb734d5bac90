"""What both roles of the ``prefill`` model share (:mod:`.prefill_model` picks one):
the inputs read, the destination descriptor parsed within fixed limits before either
role sees it, and the answer — an ack, or the job's refusal as a Triton error."""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from .disagg_common import CACHE_SALT, INPUT_IDS, KV_DESCRIPTOR, NO_TRANSFER, PREFILL_ACK
from .per_request import PerRequestModel, error_response


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
