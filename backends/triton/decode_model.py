"""The ``decode`` model: the ``llm`` model's token-level streaming front, on the shared pool.

Inputs and outputs are ``llm``'s (parsed by the same :func:`parse_token_request`)
plus ``kv_descriptor`` and ``prefill_ack`` from the steps before it. It differs from
:mod:`.llm_model` in two places: the engine's KV lives in the server's shared decode
pool (which kv_transfer receives into), and a request with a ``kv_descriptor`` is
submitted as prefilled — the engine admits it when the reservation's counter
completes (polled without blocking the batch), then runs the last prompt token as a
decode token and samples the first output token. With ``num_return_sequences`` n > 1
the transferred KV feeds the first sample; decode prefills the other n - 1 itself
(from its prefix cache, where the first sample's pages are by then).

The engine's prefix cache lives in the shared pool (decode owns it): kv_transfer looks
each prompt up there, shares the cached prefix into the reservation and has prefill
send only the rest; decode publishes a page only after its KV arrived whole.

With conditional disaggregation most requests come without a descriptor (kv_transfer
routed them ``local``): decode prefills them itself, chunked and mixed into its batch
as the colocated ``llm`` model does. Decode publishes its own prefill backlog for that
routing (:class:`~tandem.backends.disagg.decode_load.DecodeLoadBoard`) and, with
``decode_idle_threads``, runs on the prefill side's core too while that side has no
reservation to fill and its batch holds ``decode_borrow_min_seqs`` sequences or more
(:class:`~tandem.backends.disagg.decode_load.DecodeStepHook`).

A descriptor is checked whole before the engine sees it (limits, this pool's slot
range, page ids and geometry, and the reservation's secret): a forged or stale one is
refused, alone, with INVALID_ARG. A request that goes away gives its reservation up at
once. A request whose transfer fails (a prefill process that died or is restarting) is
prefilled here instead (``kv_load_failure_policy`` ``recompute``, the default). Decode also runs the pool's housekeeping, so a dead kv_transfer's reservations
fail and its pages come back without it.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from .disagg_common import KV_DESCRIPTOR, NO_TRANSFER, pool_spec
from .llm_model import TritonPythonModel as _StreamingModel


class TritonPythonModel(_StreamingModel):
    def _make_engine(self, s):
        import torch

        from tandem.backends.disagg import PoolHousekeeper, decode_engine, open_or_create
        from tandem.backends.disagg.decode_load import DecodeLoadBoard, DecodeStepHook

        # the OpenMP team is sized here, on the main thread, for the most threads the engine
        # will use: raised later from the engine thread (1 -> 2) it ran ~20x slower (measured)
        torch.set_num_threads(max(s.threads, s.idle_threads))
        self.pool = open_or_create(pool_spec(s))
        self.housekeeper = PoolHousekeeper(self.pool)
        # the pool's prefix cache keys pages by this model's version too
        engine = decode_engine(self.pool, s.model_dir, model_version=self.model_version,
                               compile_thread_counts=(s.threads, s.idle_threads),
                               kv_load_failure_policy=s.kv_load_failure_policy,
                               **(s.engine_kwargs() | {"tensor_parallel_size": s.decode_tp}))
        self.load_board = DecodeLoadBoard(self.pool.spec.name, create=True)
        self.load_board.publish(0)
        engine.step_hook = DecodeStepHook(engine, self.pool, self.load_board,
                                          s.threads, s.idle_threads, s.decode_borrow_min_seqs)
        return engine

    def _poll_metrics(self) -> None:
        self.metrics.poll_engine(self.engine, pool=self.pool,
                                 failures=self.engine.transfer_failures,
                                 recomputed=self.engine.transfer_recomputes)

    def _submit(self, request, parsed, index: int, on_output, adapter=None) -> str:
        from tandem.backends.disagg import SharedPoolTicket

        desc = pb_utils.get_input_tensor_by_name(request, KV_DESCRIPTOR).as_numpy().tobytes()
        params = parsed.sampling_params(index, self.engine.tokenizer)
        if desc == NO_TRANSFER or index > 0:
            # the transferred KV feeds sample 0; the engine has no page sharing, so the
            # other samples of num_return_sequences prefill here
            return self.engine.submit(parsed.prompt, params, on_output, lora=adapter)
        try:
            ticket = SharedPoolTicket.for_descriptor(self.pool, desc, len(parsed.prompt),
                                                     self.engine.allocator)
        except ValueError as e:
            raise ValueError(f"kv_descriptor: {e}") from None
        try:
            return self.engine.submit_prefilled(parsed.prompt, params, ticket, on_output, lora=adapter)
        except BaseException:
            ticket.cancel()   # refused here: its pages must not wait for the lease
            raise

    def finalize(self) -> None:
        super().finalize()
        housekeeper = getattr(self, "housekeeper", None)
        if housekeeper is not None:
            housekeeper.stop()
        pool, board = getattr(self, "pool", None), getattr(self, "load_board", None)
        if pool is not None:
            # the last process attached removes the files (another version may still use them)
            last = pool.close(unlink_if_last=True)
            if board is not None:
                board.close(unlink=last)
