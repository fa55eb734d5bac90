"""Triton entry point for the ``decode`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton import crash_traces

crash_traces.enable()   # a crash leaves its Python stacks in the server log

from tandem.backends.triton.decode_model import TritonPythonModel  # noqa: E402,F401
