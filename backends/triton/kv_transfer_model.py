"""The ``kv_transfer`` model: the decode node's transfer engine.

It creates (or maps) the server's shared decode pool and runs a
:class:`~tandem.rdma.KVReceiver` on it. Per request it reserves un-evictable pages for
``input_ids[:-1]`` plus the context blob, arms the reservation's counter, and
returns the destination descriptor (``kv_descriptor``) for prefill; receives run on
the receiver's own thread. An unclaimed or unfed reservation is reclaimed by lease.

It is the gate before any page is reserved: it checks the whole token request with
the parser ``decode`` uses (:func:`parse_token_request`), so a request that decode
would refuse never holds pages — in ``tandem_tokens`` no step before it checks them.
"""
from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from .disagg_common import KV_DESCRIPTOR, NO_TRANSFER, as_bytes_tensor, pool_spec
from .generate_request import RequestError, parse_token_request
from .inputs import input_getter
from .metrics import Poller, TransferMetrics
from .per_request import PerRequestModel, error_response
from .settings import EngineSettings, model_limits


class TritonPythonModel(PerRequestModel):
    def initialize(self, args: dict) -> None:
        from tandem.backends.disagg import open_or_create
        from tandem.rdma import KVReceiver

        name, version = args.get("model_name", "kv_transfer"), str(args.get("model_version", "1"))
        s = EngineSettings.from_model_config(json.loads(args["model_config"]))
        self.pool = open_or_create(pool_spec(s))
        self.context_nbytes = self.pool.spec.context_bytes
        self.metrics = TransferMetrics(name, version)
        self.receiver = KVReceiver(self.pool, name="kv_transfer", on_ready=self.metrics.on_ready)
        self.metrics_poller = Poller(lambda: self.metrics.poll_receiver(self.receiver.stats, self.pool))
        self.vocab_size, self.max_model_len = model_limits(s.model_dir)

    def respond(self, request):
        from tandem.rdma import PoolExhausted

        get = input_getter(request)

        try:
            n = len(parse_token_request(get, self.vocab_size, self.max_model_len).prompt)
        except RequestError as e:
            return error_response(str(e))
        try:
            desc = NO_TRANSFER if n <= 1 else self.receiver.reserve(
                n - 1, context_nbytes=(self.context_nbytes,)).to_bytes()
        except PoolExhausted as e:
            return error_response(
                f"the decode KV pool is full ({e}); retry later", pb_utils.TritonError.UNAVAILABLE)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(KV_DESCRIPTOR, as_bytes_tensor(desc))])

    def finalize(self) -> None:
        receiver, pool = getattr(self, "receiver", None), getattr(self, "pool", None)
        poller = getattr(self, "metrics_poller", None)
        if poller is not None:
            poller.stop()
        if receiver is not None:
            receiver.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()   # while the stub can still talk to the server
            self.metrics = None
        if pool is not None:
            # the last process attached removes the files (another version may still use them)
            pool.close(unlink_if_last=True)
