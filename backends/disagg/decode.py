"""The decode side: the engine on the shared decode pool, and the ticket through which
it learns that a reservation's KV arrived.
"""
from __future__ import annotations

from tandem.rdma import ReservationGone, SharedKVPool, SharedPageAllocator

from ..engine.async_engine import AsyncEngine
from ..engine.remote_prefill import KVTransferFailed
from .kv_views import shared_page_pool
from .pool import TARGET


class SharedPoolTicket:
    """A reservation (slot, generation) of the shared pool, seen by the decoder.

    Polling reads the slot's counter state without a lock; only when the slot is READY
    does :meth:`poll` take the lock to claim the pages.
    """

    __slots__ = ("pool", "slot", "generation")

    def __init__(self, pool: SharedKVPool, slot: int, generation: int):
        self.pool, self.slot, self.generation = pool, slot, generation

    def poll(self) -> list[int] | None:
        st = self.pool.poll(self.slot, self.generation)
        if st.failed:
            raise KVTransferFailed(f"KV transfer for reservation {self.slot}/{self.generation} "
                                   f"failed: {st.reason}", st.reason_code)
        if not st.ready:
            return None
        try:
            return self.pool.claim(self.slot, self.generation)
        except ReservationGone as e:
            raise KVTransferFailed(str(e), "gone") from None

    def cancel(self) -> None:
        # Pages with receives still in flight are the receiver's to free: leave an
        # unfinished reservation to its lease (it fails as unclaimed or timed out).
        if self.pool.poll(self.slot, self.generation).ready:
            try:
                self.pool.free(self.pool.claim(self.slot, self.generation))
            except ReservationGone:
                pass


def decode_engine(pool: SharedKVPool, model_dir: str, rank: int = 0, **engine_args) -> AsyncEngine:
    """An :class:`AsyncEngine` whose target KV (and with ``speculative`` in
    ``engine_args`` the proposer's) lives in ``pool`` (not started)."""
    m = pool.model(TARGET)
    engine_args = {"page_size": m.page_size, "kv_layout": m.kv_layout, **engine_args}
    spec = engine_args.get("speculative")
    proposer_pool = None
    if spec is not None and spec.enabled:
        have = [x.name for x in pool.spec.models]
        if spec.kv_name not in have:
            raise ValueError(f"speculative method {spec.method!r} keeps its KV as "
                             f"{spec.kv_name!r}; the shared pool holds {have}")
        proposer_pool = shared_page_pool(pool, rank, spec.kv_name)
    return AsyncEngine(model_dir, kv_pool=shared_page_pool(pool, rank, TARGET),
                       allocator=SharedPageAllocator(pool), proposer_kv_pool=proposer_pool,
                       **engine_args)
