"""Peer processes for the disaggregation tests: the receiver host of the rdma tests
(kv_transfer) and a prefill server (:class:`PrefillService`), driven over a pipe."""
from __future__ import annotations

import threading

from ..rdma import peers as rdma_peers
from ..rdma.peers import (Peer as _RdmaPeer, _ctx, pid, pool_call, pool_open,  # noqa: F401
                          rx_reserve, rx_start, rx_stats)

_state: dict = {}


def _serve(conn) -> None:
    import multiprocessing

    import torch
    torch.set_num_threads(1)
    # the prefill may start tensor-parallel ranks, and multiprocessing lets no daemonic
    # process have children; this peer's parent still ends it (Peer.close)
    multiprocessing.current_process().daemon = False
    rdma_peers.serve_loop(conn, globals())


class Peer(_RdmaPeer):
    """A spawned process that runs this module's functions on request."""
    serve = staticmethod(_serve)


def shutdown() -> None:
    svc = _state.pop("prefill", None)
    if svc is not None:
        svc.shutdown()
    rdma_peers.reset()


def prefill_start(model_dir: str, timeout_s: float = 15.0, faults: str | None = None,
                  **engine_args) -> None:
    from tandem.backends.disagg import PrefillService
    from tandem.backends.engine import EngineConfig
    from tandem.rdma import Faults, SenderConfig
    if "prefill" in _state:
        _state.pop("prefill").shutdown()
    # fp32 as the decode side's pool (the decode_pool fixture): "auto" could pick bf16 here
    svc = PrefillService(EngineConfig(model_dir, **{"dtype": "float32", **engine_args}),
                         SenderConfig(timeout_s=timeout_s, faults=Faults.parse(faults)))
    svc.start()
    _state["prefill"] = svc


def prefill_run(jobs, wait_s: float = 60.0) -> list:
    """Prefill every (descriptor bytes, prompt ids) job; the on_done results, in order."""
    from tandem.rdma import DestinationDescriptor
    svc = _state["prefill"]
    results, left = [None] * len(jobs), threading.Semaphore(0)

    def done(i, err):
        results[i] = err or "ok"
        left.release()
    for i, (desc, ids) in enumerate(jobs):
        svc.submit(DestinationDescriptor.from_bytes(desc), ids, lambda e, i=i: done(i, e))
    for _ in jobs:
        if not left.acquire(timeout=wait_s):
            raise TimeoutError(f"prefill did not finish within {wait_s}s: {results}")
    return results


def prefill_submit(desc: bytes, ids: list[int]):
    """Submit one job; returns the error ``submit`` raised (None: accepted)."""
    from tandem.rdma import DestinationDescriptor
    try:
        _state["prefill"].submit(DestinationDescriptor.from_bytes(desc), ids, lambda e: None)
    except ValueError as e:
        return str(e)
    return None


def pool_reserve_churn(seconds: float, seed: int) -> tuple[int, int]:
    """Reserve and fail at random for ``seconds``, as kv_transfer does under load;
    returns (reservations made, refused because the pool was full)."""
    import random
    import time
    from tandem.rdma import PoolExhausted
    from tandem.rdma.shared_pool import CANCELLED
    pool, rng = rdma_peers._state["pool"], random.Random(seed)
    made = full = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            slot, gen, _ = pool.reserve(rng.randint(1, 6), 1, 30.0)
        except PoolExhausted:
            full += 1
            continue
        made += 1
        time.sleep(0.0005)
        pool.fail(slot, gen, CANCELLED)
    return made, full


def prefill_pages() -> tuple[int, int]:
    """(free, total) pages of the prefill pool."""
    a = _state["prefill"].engine.allocator
    return a.num_free, a.num_pages


def prefill_fragment(seed: int = 0) -> None:
    """Scramble the prefill pool's free list (as after many requests of mixed sizes)."""
    import random
    a = _state["prefill"].engine.allocator
    held = a.alloc(a.num_free)
    random.Random(seed).shuffle(held)
    a.free(held)
