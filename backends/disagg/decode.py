"""The decode side: the engine on the shared decode pool (with the pool's prefix cache,
:mod:`.shared_cache`), the ticket through which it learns that a reservation's KV
arrived, and the pool housekeeping decode runs too.
"""
from __future__ import annotations

import logging
import threading

from tandem.rdma import DestinationDescriptor, ReservationGone, SharedKVPool, SharedPageAllocator
from tandem.rdma.descriptor import check_for_pool
from tandem.rdma.wire import MalformedMessage

from ..engine.async_engine import AsyncEngine
from ..engine.config import EngineConfig
from ..engine.prefix_caching import model_root
from ..engine.remote_prefill import RECOMPUTE, KVTransferFailed
from .kv_views import RankShare, shared_page_pool
from .pool import TARGET
from .shared_cache import SharedCachingAllocator

log = logging.getLogger(__name__)


class SharedPoolTicket:
    """A reservation (slot, generation) of the shared pool, seen by the decoder; its
    secret is what entitles the decoder to the pages.

    Polling reads the slot's counter state without a lock; only when the slot is READY
    does :meth:`poll` take the lock to claim the pages. :meth:`cancel` gives the
    reservation up at once (the receiver stops taking its data and tells the sender).
    """

    __slots__ = ("pool", "slot", "generation", "secret", "num_cached_pages", "allocator")

    def __init__(self, pool: SharedKVPool, slot: int, generation: int, secret: bytes | None = None,
                 num_cached_pages: int = 0, allocator=None):
        """``num_cached_pages``: the reservation's first pages are decode's cached ones
        (shared, not received); ``allocator``: the claimer's, which adopts the claimed
        pages (a caching allocator counts its references to them)."""
        self.pool, self.slot, self.generation, self.secret = pool, slot, generation, secret
        self.num_cached_pages = num_cached_pages
        self.allocator = allocator or SharedPageAllocator(pool)

    @classmethod
    def for_descriptor(cls, pool: SharedKVPool, data: bytes, prompt_len: int | None = None,
                       allocator=None) -> "SharedPoolTicket":
        """The ticket of a descriptor that arrived as bytes, after every check: it
        parses within its limits, points into this pool (slot, page ids, models,
        sharding, context), holds ``prompt_len - 1`` tokens (when given), and names a
        reservation of this pool by its secret. Raises ``ValueError`` (a
        :class:`MalformedMessage`) saying what is wrong; no plan is built and nothing
        is touched."""
        d = DestinationDescriptor.from_bytes(data)
        check_for_pool(d, pool.spec)
        if prompt_len is not None and d.num_tokens != prompt_len - 1:
            raise MalformedMessage(f"the reservation holds {d.num_tokens} tokens; this prompt "
                                   f"of {prompt_len} prefills {prompt_len - 1}")
        if not pool.verify(d.slot, d.generation, d.secret):
            raise MalformedMessage(f"no reservation {d.slot}/{d.generation} of this pool has "
                                   "that secret")
        return cls(pool, d.slot, d.generation, d.secret, d.first_page, allocator)

    def poll(self) -> list[int] | None:
        st = self.pool.poll(self.slot, self.generation)
        if st.failed:
            raise KVTransferFailed(f"KV transfer for reservation {self.slot}/{self.generation} "
                                   f"failed: {st.reason}", st.reason_code)
        if not st.ready:
            return None
        try:
            pages = self.pool.claim(self.slot, self.generation, self.secret)
        except ReservationGone as e:
            raise KVTransferFailed(str(e), "gone") from None
        self.allocator.adopt(pages)
        return pages

    def cancel(self) -> None:
        """Free a READY reservation now; ask the receiver to end a RESERVED one (it
        frees the pages as soon as no receive into them is in flight, and aborts the
        prefill)."""
        if self.secret is not None:
            self.pool.cancel(self.slot, self.generation, self.secret)
        elif self.pool.poll(self.slot, self.generation).ready:
            try:
                pages = self.pool.claim(self.slot, self.generation)
            except ReservationGone:
                return
            self.allocator.adopt(pages)
            self.allocator.free(pages)


class PoolHousekeeper:
    """A thread that runs :meth:`SharedKVPool.housekeep` every ``every_s``: a dead
    kv_transfer's reservations fail (its pages come back) and unclaimed ones expire
    even when no kv_transfer is alive to do it."""

    def __init__(self, pool: SharedKVPool, every_s: float = 1.0):
        self.pool, self.every_s = pool, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-pool-housekeeper",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if self.pool.housekeep():
                    log.warning("shared KV pool: reclaimed the reservations and pages of a "
                                "process that died")
            except Exception:
                log.exception("shared KV pool housekeeping failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def decode_engine(pool: SharedKVPool, model_dir: str, rank: int = 0, **engine_args) -> AsyncEngine:
    """An :class:`AsyncEngine` whose target KV (and with ``speculative`` in
    ``engine_args`` the proposer's) lives in ``pool`` (not started). With
    ``enable_prefix_caching`` (the default) and a pool that has a prefix cache, the
    engine caches prompt pages in the pool, where kv_transfer finds them;
    ``kv_load_failure_policy`` (``recompute``, the default, or ``fail``): what a request
    whose transfer failed gets (:mod:`tandem.backends.engine.remote_prefill`)."""
    m = pool.model(TARGET)
    engine_args = {**engine_args, "page_size": m.page_size, "kv_layout": m.kv_layout}
    engine_args.pop("num_pages", None)   # the pool's
    failure_policy = engine_args.pop("kv_load_failure_policy", RECOMPUTE)
    config = EngineConfig(str(model_dir), **engine_args)
    if config.enable_prefix_caching and pool.caching:
        allocator = SharedCachingAllocator(pool, model_root(config))
    else:
        allocator = SharedPageAllocator(pool)
    spec = engine_args.get("speculative")
    proposer_pool = None
    if spec is not None and spec.has_kv:
        have = [x.name for x in pool.spec.models]
        if spec.kv_name not in have:
            raise ValueError(f"speculative method {spec.method!r} keeps its KV as "
                             f"{spec.kv_name!r}; the shared pool holds {have}")
        proposer_pool = shared_page_pool(pool, rank, spec.kv_name)
    if pool.spec.scheme.tp_size != config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, but the shared pool "
                         f"{pool.spec.name!r} is split for {pool.spec.scheme.tp_size} decode rank(s)")
    ranks = RankShare(pool.spec.name, TARGET) if config.tensor_parallel_size > 1 else None
    return AsyncEngine(model_dir, kv_pool=shared_page_pool(pool, rank, TARGET),
                       allocator=allocator, proposer_kv_pool=proposer_pool,
                       kv_load_failure_policy=failure_policy, rank_kv_pools=ranks, **engine_args)
