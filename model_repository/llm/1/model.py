"""Triton entry point for the ``llm`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.llm_model import TritonPythonModel  # noqa: F401
