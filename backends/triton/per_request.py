"""The shape of Tandem's non-decoupled models: one response per request, in order,
and a request's error in its own response only."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils


def error_response(message: str, code=None):
    """A response that carries only an error (Triton's default code unless ``code``)."""
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


class PerRequestModel:
    """``execute`` answers each request with :meth:`respond`."""

    def execute(self, requests):
        return [self.respond(r) for r in requests]

    def respond(self, request):
        raise NotImplementedError
