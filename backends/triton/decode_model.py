"""The ``decode`` model: the ``llm`` model's token-level streaming front, on the shared pool.

Inputs and outputs are ``llm``'s (parsed by the same :func:`parse_token_request`)
plus ``kv_descriptor`` and ``prefill_ack`` from the steps before it. It differs from
:mod:`.llm_model` in two places: the engine's KV lives in the server's shared decode
pool (which kv_transfer receives into), and a request with a ``kv_descriptor`` is
submitted as prefilled — the engine admits it when the reservation's counter
completes (polled without blocking the batch), then runs the last prompt token as a
decode token and samples the first output token. With ``num_return_sequences`` n > 1
the transferred KV feeds the first sample; the engine shares no pages between
sequences, so decode prefills the other n - 1 itself.

A descriptor is checked whole before the engine sees it (limits, this pool's slot
range, page ids and geometry, and the reservation's secret): a forged or stale one is
refused, alone, with INVALID_ARG. A request that goes away gives its reservation up at
once. Decode also runs the pool's housekeeping, so a dead kv_transfer's reservations
fail and its pages come back without it.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from .disagg_common import KV_DESCRIPTOR, NO_TRANSFER, pool_spec
from .llm_model import TritonPythonModel as _StreamingModel


class TritonPythonModel(_StreamingModel):
    def _make_engine(self, s):
        from tandem.backends.disagg import PoolHousekeeper, decode_engine, open_or_create

        self.pool = open_or_create(pool_spec(s))
        self.housekeeper = PoolHousekeeper(self.pool)
        return decode_engine(self.pool, s.model_dir, dtype=s.dtype,
                             max_num_seqs=s.max_num_seqs,
                             max_num_batched_tokens=s.max_num_batched_tokens,
                             speculative=s.speculative())

    def _poll_metrics(self) -> None:
        self.metrics.poll_engine(self.engine.engine, pool=self.pool,
                                 failures=self.engine.transfer_failures)

    def _submit(self, request, parsed, index: int, on_output) -> str:
        from tandem.backends.disagg import SharedPoolTicket

        desc = pb_utils.get_input_tensor_by_name(request, KV_DESCRIPTOR).as_numpy().tobytes()
        params = parsed.sampling_params(index, self.engine.tokenizer)
        if desc == NO_TRANSFER or index > 0:
            # the transferred KV feeds sample 0; the engine has no page sharing, so the
            # other samples of num_return_sequences prefill here
            return self.engine.submit(parsed.prompt, params, on_output)
        try:
            ticket = SharedPoolTicket.for_descriptor(self.pool, desc, len(parsed.prompt))
        except ValueError as e:
            raise ValueError(f"kv_descriptor: {e}") from None
        try:
            return self.engine.submit_prefilled(parsed.prompt, params, ticket, on_output)
        except BaseException:
            ticket.cancel()   # refused here: its pages must not wait for the lease
            raise

    def finalize(self) -> None:
        super().finalize()
        housekeeper = getattr(self, "housekeeper", None)
        if housekeeper is not None:
            housekeeper.stop()
        pool = getattr(self, "pool", None)
        if pool is not None:
            # the last process attached removes the files (another version may still use them)
            pool.close(unlink_if_last=True)
