"""Triton entry point for the ``prefill`` model; the code lives in tandem.backends.triton.
The model's config picks its role (local prefill, or forwarding to prefill servers),
so this adapter hands each call to the one it picked."""

from tandem.backends.triton.crash_traces import enable as enable_crash_traces

enable_crash_traces()   # a crash leaves its Python stacks in the server log

from tandem.backends.triton.prefill_model import prefill_model_for  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.model = prefill_model_for(args)
        self.model.initialize(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        if getattr(self, "model", None) is not None:
            self.model.finalize()
