"""Triton entry point for the ``prefill`` model; the code lives in tandem.backends.triton."""

from tandem.backends.triton.crash_traces import enable as enable_crash_traces

enable_crash_traces()   # a crash leaves its Python stacks in the server log

from tandem.backends.triton.prefill_model import PrefillModel as TritonPythonModel  # noqa: E402,F401
