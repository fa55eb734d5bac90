"""Real processes for the transfer tests: a receiver host (kv_transfer) and sender
ranks (prefill), driven by the test over a local pipe.

Each peer process keeps its objects in module globals and runs the named function of
this module for every command. Source KV is deterministic (:func:`full_kv` from a
seed), so the test process recomputes what every destination page must hold.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import asdict

import numpy as np

from tandem.rdma import (DestinationDescriptor, KVReceiver, KVSender, ModelSpec, ReceiverConfig,
                         SenderConfig, ShardScheme, SharedKVPool, SourcePool)
from tandem.rdma.pool_layout import H_FREE_TOP
from tandem.rdma.transport import Transport
from tandem.rdma.wire import data_tag

_ctx = mp.get_context("spawn")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


# -- reference data (pure) -------------------------------------------------------------
def full_kv(spec: ModelSpec, num_pages: int, seed: int) -> np.ndarray:
    """All heads of a prefill pool, logical HND order [L, P, 2, H, page_size, D], as
    random unsigned integers of the dtype's width (bit patterns are all that move)."""
    rng = np.random.default_rng(seed)
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[spec.itemsize]
    return rng.integers(0, np.iinfo(dtype).max, (spec.num_layers, num_pages, 2, spec.num_kv_heads,
                                                 spec.page_size, spec.head_dim), dtype=dtype)


def rank_pool(full: np.ndarray, layout: str, heads: tuple[int, int]) -> np.ndarray:
    """One rank's pool of a head range, in the given layout, as flat bytes."""
    part = full[:, :, :, heads[0]:heads[1]]
    if layout == "NHD":
        part = part.transpose(0, 1, 2, 4, 3, 5)
    return np.ascontiguousarray(part).view(np.uint8).reshape(-1)


def expected_dst_page(full: np.ndarray, layout: str, src_page: int, heads: tuple[int, int]):
    part = full[:, src_page, :, heads[0]:heads[1]]
    if layout == "NHD":
        part = part.transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(part).view(np.uint8).reshape(full.shape[0], -1)


# -- peer processes --------------------------------------------------------------------
class Peer:
    """A spawned process that runs this module's functions on request."""

    def __init__(self, name: str):
        self.name = name
        self.conn, child = _ctx.Pipe()
        self.proc = _ctx.Process(target=type(self).serve, args=(child,), name=name, daemon=True)
        self.proc.start()
        child.close()

    @classmethod
    def started(cls, name: str) -> "Peer":
        """A peer whose process is up and has imported its module."""
        p = cls(name)
        p("pid")
        return p

    def __call__(self, fn: str, *args, timeout: float = 60.0, **kwargs):
        self.conn.send((fn, args, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: {fn} did not answer within {timeout}s")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"{self.name}: {fn} failed:\n{value}")
        return value

    def send(self, fn: str, *args, **kwargs) -> None:
        """Start a command without waiting for its answer (collect it with :meth:`result`)."""
        self.conn.send((fn, args, kwargs))

    def result(self, timeout: float = 60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout}s")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("shutdown", timeout=10)
            except Exception:  # noqa: BLE001
                pass
            self.proc.join(10)
        self.kill()


def serve_loop(conn, namespace: dict) -> None:
    """Run ``namespace[fn](*args, **kwargs)`` for each request on the pipe until shutdown."""
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, namespace[fn](*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test
            conn.send((False, traceback.format_exc()))
        if fn == "shutdown":
            return


def _serve(conn) -> None:
    serve_loop(conn, globals())


Peer.serve = staticmethod(_serve)
_state: dict = {}


def shutdown() -> None:
    """Release everything; the peer process then exits."""
    reset()


def reset() -> None:
    """Release this peer's receiver, sender, raw worker and pool; the process lives on."""
    for key in ("rx", "tx", "raw"):
        obj = _state.pop(key, None)
        if obj is not None:
            obj.close()
    pool = _state.pop("pool", None)
    if pool is not None:
        pool.close(release=False)


def pid() -> int:
    return os.getpid()


# receiver host ------------------------------------------------------------------------
def rx_start(pool_name: str, fail_grace_s: float = 30.0, faults: str | None = None,
             **config) -> bytes:
    """A receiver on the named pool (``faults``: a TANDEM_FAULTS string)."""
    from tandem.rdma import Faults
    if "rx" in _state:
        _state.pop("rx").close()
        _state.pop("pool").close(release=False)
    _state["pool"] = SharedKVPool.open(pool_name, fail_grace_s=fail_grace_s)
    _state["rx"] = KVReceiver(_state["pool"], ReceiverConfig(faults=Faults.parse(faults),
                                                             **config))
    return _state["rx"].address


def rx_drain(timeout_s: float) -> bool:
    return _state["rx"].drain(timeout_s)


def rx_reserve(num_tokens: int, src=(1, 1), context_nbytes=(), seed: int = 0,
               max_run_pages: int | None = None, timeout_s: float | None = None,
               cached_keys=()) -> bytes:
    d = _state["rx"].reserve(num_tokens, ShardScheme(*src), context_nbytes, seed=seed,
                             max_run_pages=max_run_pages, timeout_s=timeout_s,
                             cached_keys=list(cached_keys))
    return d.to_bytes()


def rx_wait(slot: int, gen: int, wait_s: float = 30.0) -> tuple:
    st = _state["rx"].wait(slot, gen, wait_s)
    return st.state, st.completed, st.expected, st.error


def rx_cancel(slot: int, gen: int) -> None:
    _state["rx"].cancel(slot, gen)


def rx_trace(slot: int, gen: int) -> dict:
    t = _state["rx"].trace(slot, gen)
    return {"reserved_at": t.reserved_at, "layer_done_at": dict(t.layer_done_at),
            "ready_at": t.ready_at, "failed": t.failed}


def rx_stats() -> dict:
    return asdict(_state["rx"].stats)


# sender ranks -------------------------------------------------------------------------
def tx_start(models, num_pages: int, rank: int, scheme=(1, 1), seed: int = 0,
             faults: str | None = None, **config) -> bytes:
    """A sender for ``rank`` of ``scheme`` whose pools hold the rank's heads of
    :func:`full_kv` (seed + model index); ``faults``: a TANDEM_FAULTS string."""
    from tandem.rdma import Faults
    config["faults"] = Faults.parse(faults)
    if "tx" in _state:
        _state.pop("tx").close()
    scheme = ShardScheme(*scheme)
    pools = {}
    for i, spec in enumerate(models):
        heads = scheme.head_range(rank, spec.num_kv_heads)
        data = rank_pool(full_kv(spec, num_pages, seed + i), spec.kv_layout, heads)
        pools[spec.name] = SourcePool(spec, heads[1] - heads[0], num_pages, data)
    _state["tx"] = KVSender(pools, rank, scheme, SenderConfig(**config))
    _state["freed"] = []
    return _state["tx"].address


def tx_give_up(desc: bytes) -> None:
    """The sender tells the descriptor's receiver it will send nothing (its prefill failed)."""
    from tandem.rdma import DestinationDescriptor
    _state["tx"].give_up(DestinationDescriptor.from_bytes(desc))


def tx_run(jobs, chunk_tokens: int = 1 << 30, layer_delay_s: float = 0.0,
           context: bool = True, wait_s: float = 30.0, die_after_layers: int | None = None):
    """Run prefill for several requests at once, as one batch.

    ``jobs``: list of (descriptor bytes, source page ids). Each forward step computes
    the next ``chunk_tokens`` tokens of every unfinished request, for every model.
    """
    tx: KVSender = _state["tx"]
    transfers = []
    for desc_bytes, src_pages in jobs:
        desc = DestinationDescriptor.from_bytes(desc_bytes)
        transfers.append(tx.begin(desc, src_pages,
                                  on_done=lambda t: _state["freed"].append(len(t.src_pages))))
    done_tokens = {t: 0 for t in transfers}
    layers_run = 0
    while any(done_tokens[t] < t.desc.num_tokens for t in transfers):
        chunk = {t: min(done_tokens[t] + chunk_tokens, t.desc.num_tokens)
                 for t in transfers if done_tokens[t] < t.desc.num_tokens}
        for spec in transfers[0].plan.models:
            step = tx.step(spec.name, chunk)
            for layer in range(spec.num_layers):
                time.sleep(layer_delay_s)
                step.layer_done(layer)
                layers_run += 1
                if die_after_layers is not None and layers_run == die_after_layers:
                    time.sleep(0.2)   # let the messenger send what is ready
                    os.kill(os.getpid(), signal.SIGKILL)
        done_tokens.update(chunk)
    if context:
        for t in transfers:
            tx.send_context(t, [np.full(n, i + 1, dtype=np.uint8)
                                for i, n in enumerate(t.plan.context_nbytes)])
    out = []
    for t in transfers:
        try:
            t.wait(wait_s)
            err = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            err = f"{type(e).__name__}: {e}"
        out.append({"sent": t.sent, "completed": t.completed, "total": t.total,
                    "staged": t.staged, "error": err,
                    "layer_computed_at": dict(t.layer_computed_at),
                    "finished_at": t.finished_at})
    return out


def tx_state() -> dict:
    tx: KVSender = _state["tx"]
    return {"active": len(tx._active), "peers": len(tx._peers), "freed": list(_state["freed"]),
            "stats": asdict(tx.stats)}


# a raw UCX peer for protocol tests ----------------------------------------------------
def raw_start() -> bytes:
    if "raw" not in _state:
        _state["raw"] = Transport("raw")   # answers nothing, drains nothing
    return _state["raw"].address


def raw_open(address: bytes, desc_bytes: bytes, secret: bytes | None = None) -> None:
    """Open a reservation as a sender would (with ``secret``, default the descriptor's);
    the receiver's answer is left unread."""
    from tandem.rdma.wire import Open, control_tag, encode_control
    d = DestinationDescriptor.from_bytes(desc_bytes)
    msg = encode_control(Open(1, _state["raw"].address, d.slot, d.generation,
                              d.secret if secret is None else secret))
    assert raw_send(address, [(control_tag(), msg)]) == ["ok"]


def raw_send(address: bytes, messages, wait_s: float = 10.0) -> list:
    """Send ``(tag, payload bytes)`` messages; returns per-message error strings."""
    t: Transport = _state["raw"]
    results: list = [None] * len(messages)
    left = [len(messages)]

    def go():
        ep = t.endpoint(address)
        for i, (tag, payload) in enumerate(messages):
            def done(err, i=i):
                results[i] = "ok" if err is None else str(err)
                left[0] -= 1
            t.send(ep, np.frombuffer(payload, dtype=np.uint8).copy(), tag, address, done)
    t.call(go)
    deadline = time.monotonic() + wait_s
    while left[0] and time.monotonic() < deadline:
        time.sleep(0.005)
    return results


def payload(nbytes: int, fill: int) -> bytes:
    return bytes([fill]) * nbytes


def wait_for(condition, timeout_s: float = 10.0, every_s: float = 0.01) -> None:
    """Poll ``condition()`` until true; fail after ``timeout_s`` (a hang, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s}s")
        time.sleep(every_s)


__all__ = ["Peer", "full_kv", "rank_pool", "expected_dst_page", "data_tag", "payload", "wait_for"]


# shared pool from another process -----------------------------------------------------
def pool_open(name: str, fail_grace_s: float = 30.0) -> int:
    if "pool" in _state:
        _state.pop("pool").close(release=False)
    _state["pool"] = SharedKVPool.open(name, fail_grace_s=fail_grace_s)
    return os.getpid()


def pool_call(method: str, *args):
    return getattr(_state["pool"], method)(*args)


def pool_create(spec, server_pid: int | None = None) -> int:
    """Create a pool for server ``server_pid`` (default: this process)."""
    if "pool" in _state:
        _state.pop("pool").close(release=False)
    _state["pool"] = SharedKVPool.create(spec, server_pid=server_pid)
    return os.getpid()


def pool_half_create(spec, server_pid: int) -> None:
    """Start creating a pool's control file (its header names the server and this
    creator) and stop before it is initialised, as a creator killed half-way would."""
    from tandem.rdma.pool_layout import ControlBlock
    ctl = ControlBlock(spec, create=True)
    ctl.set_server(server_pid)
    _state["half"] = ctl


def pool_hammer(rounds: int, seed: int) -> int:
    """Allocate and free at random; mark each held page with this pid in its first bytes
    and count pages found re-marked by someone else (double allocations)."""
    pool: SharedKVPool = _state["pool"]
    model = pool.spec.models[0].name
    pb = pool.page_bytes(model)
    kv = pool.kv(0, model)
    me = np.frombuffer(np.int32(os.getpid()).tobytes(), np.uint8)
    rng = np.random.default_rng(seed)
    held, violations = [], 0
    for _ in range(rounds):
        if held and (rng.random() < 0.5 or pool.num_free == 0):
            pages = held.pop(int(rng.integers(len(held))))
            for p in pages:
                violations += int(not (kv[p * pb:p * pb + 4] == me).all())
            pool.free(pages)
        else:
            try:
                pages = pool.alloc(int(rng.integers(1, 4)))
            except Exception:  # noqa: BLE001 - out of pages under contention
                continue
            for p in pages:
                kv[p * pb:p * pb + 4] = me
            held.append(pages)
    for pages in held:
        pool.free(pages)
    return violations


def pool_die_mid_change(n: int) -> None:
    """Take the pool lock, pop ``n`` pages off the free stack without recording an
    owner, and die holding the lock: the worst moment to crash."""
    pool: SharedKVPool = _state["pool"]
    with pool._locked():
        pool._ctl.hdr[H_FREE_TOP] -= n
        os.kill(os.getpid(), signal.SIGKILL)
