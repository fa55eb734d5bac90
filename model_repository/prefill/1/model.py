"""Triton entry point for the ``prefill`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.prefill_model import TritonPythonModel  # noqa: F401
