"""Triton entry point for the ``preprocess`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.preprocess_model import TritonPythonModel  # noqa: F401
