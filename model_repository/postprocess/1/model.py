"""Triton entry point for the ``postprocess`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.postprocess_model import TritonPythonModel  # noqa: F401
