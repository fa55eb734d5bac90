"""The ``cancel`` model: a client of a ``*_direct`` ensemble gives one stream up.

The direct ensembles end at the engine model (no postprocess step, one hop less per
token), and Triton 2.51 does not pass an ensemble's cancellation on to the step in
flight, so the client cancels explicitly: it sends the ``cancel_token`` its stream's
responses carry, and this model hands it to the engine model's listener
(:mod:`.cancel_channel`), which aborts the sequence and ends its stream. The stub runs
in the same server as the engine models (the listener's address is keyed by the
server's pid). Not decoupled, no torch, idle when unused.
"""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from .cancel_channel import CANCEL_TOKEN, is_token, send_cancel
from .generate_request import RequestError, scalar
from .inputs import input_getter
from .per_request import PerRequestModel, error_response


class TritonPythonModel(PerRequestModel):
    def respond(self, request):
        try:
            token = scalar(input_getter(request), CANCEL_TOKEN)
        except RequestError as e:
            return error_response(str(e), pb_utils.TritonError.INVALID_ARG)
        if token is None or not is_token(bytes(token)):
            return error_response(f"{CANCEL_TOKEN}: not a cancel token (expected <endpoint>/<32 hex digits>, "
                                  "as a direct ensemble's responses carry it)", pb_utils.TritonError.INVALID_ARG)
        sent = send_cancel(bytes(token))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("cancelled", np.array([sent]))])
