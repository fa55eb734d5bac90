"""Triton entry point for the ``decode`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.decode_model import TritonPythonModel  # noqa: F401
