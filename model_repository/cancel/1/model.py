"""Triton entry point for the ``cancel`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.cancel_model import TritonPythonModel  # noqa: F401
