"""Triton entry point for the ``kv_transfer`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.kv_transfer_model import TritonPythonModel  # noqa: F401
