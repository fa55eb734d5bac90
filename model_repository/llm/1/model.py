"""Triton entry point for the ``llm`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton import crash_traces

crash_traces.enable()   # a crash leaves its Python stacks in the server log

from tandem.backends.triton.llm_model import TritonPythonModel  # noqa: E402,F401
