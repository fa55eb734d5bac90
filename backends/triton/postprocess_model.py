"""The ``postprocess`` model: an engine reply becomes an ensemble response (the
prompt echo: :mod:`.postprocess`), and a client's cancellation reaches the engine.

Triton passes an ensemble's cancellation on to the steps it schedules afterwards,
not to the engine step already streaming; so this step, which runs once per engine
reply, is where a cancelled request shows. It sends the reply's ``cancel_token`` back
to the engine model (:mod:`.cancel_channel`), which aborts the sequence and ends its
stream. It still answers normally: in Triton 2.51 an ensemble step that fails while
the engine step is in flight leaks the ensemble request (see :mod:`.in_flight`), and
the client already has its CANCELLED. A stream's replies are asked about at most once
per 50 ms (:class:`~.postprocess.CancelChecks`): each ask is a round trip to the server.
Not decoupled, one response per request, not batched (Triton's dynamic batcher
finishes a cancelled request without executing it: the cancellation would never show
here), no torch work.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from .cancel_channel import CANCEL_TOKEN, send_cancel
from .generate_request import RequestError, scalar
from .inputs import input_getter
from .per_request import PerRequestModel, error_response
from .postprocess import CancelChecks, ensemble_outputs


class TritonPythonModel(PerRequestModel):
    def initialize(self, args) -> None:
        self.cancel_checks = CancelChecks()

    def respond(self, request):
        get = input_getter(request)

        try:
            token = scalar(get, CANCEL_TOKEN)
            if self.cancel_checks.due(None if token is None else bytes(token)) and request.is_cancelled():
                if token is not None and not send_cancel(token):
                    pb_utils.Logger.log_warn("[postprocess] the engine model of a cancelled request did not "
                                             "take its cancel token; the sequence runs to its end")
            outputs = ensemble_outputs(get)
        except RequestError as e:
            return error_response(str(e))
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])
