"""A thin layer over ucxx: one UCX worker progressed by its own thread.

Every UCX call happens on that thread; other threads hand it work with
:meth:`Transport.submit` / :meth:`Transport.call`, so nothing blocks the engine. The
thread uses blocking progress: it progresses until UCX is idle, arms the worker and
sleeps in ``select`` on the worker's epoll fd and a wake-up eventfd, so an idle
transport burns no CPU.

Data endpoints are created from worker addresses with peer-failure error handling
*off*: that is what lets UCX pick the shared-memory transports (CMA zero-copy
rendezvous on one host, ~10x faster than tcp/lo here). Each side also keeps an
error-handled *watch* endpoint to its peer (:meth:`Transport.watch`): UCX reports the
peer's death on it within milliseconds, which is how a rendezvous receive from a dead
sender — which over TCP would never complete — is given up safely (the sender, dead,
can write nothing more), and how a sender learns its receiver died. Watch endpoints
live on a second worker of the same context: UCX pairs endpoints two workers create
to each other, and refuses a pair whose error handling differs, so the two kinds
must never be created between the same two workers.

Which network interfaces the worker listens on is :func:`ucx_config`'s
``net_devices``: loopback (``lo``) by default, so a single-host server exposes no
UCX port; multi-host serving names its interfaces (``eth0``, ``mlx5_0:1``) or
``all`` (``tandem serve --kv-interface``). ``transports`` restricts UCX's transports
(``tcp``: no shared memory or CMA even between processes UCX sees on one host, e.g.
servers in separate network namespaces; ``tandem serve --kv-transports``).

>>> t = Transport("doc")
>>> t.call(lambda: len(t.address) > 0)
True
>>> t.close()
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import select
import threading
import time
from typing import Callable

import ucxx._lib.libucxx as ucx_api
from ucxx._lib.arr import Array

log = logging.getLogger(__name__)

Done = Callable[[Exception | None], None]

DEFAULT_NET_DEVICES = "lo"


def ucx_config(net_devices: str | None = None, transports: str | None = None) -> dict:
    """UCX context settings for a transport: ``net_devices`` (comma-separated UCX
    device names, ``all`` for UCX's own choice, None or "" for the default ``lo``)
    restricts the network devices UCX listens and connects on (``UCX_NET_DEVICES``).
    Shared-memory transports are not network devices and stay available on one host
    unless ``transports`` (``UCX_TLS``: ``tcp``, ``rc,ud,sm``, ``^cma``; None, "" or
    ``all``: UCX's choice) leaves them out.

    >>> ucx_config(), ucx_config("all"), ucx_config("eth0,lo")
    ({'NET_DEVICES': 'lo'}, {}, {'NET_DEVICES': 'eth0,lo'})
    >>> ucx_config("veth0", "tcp")
    {'NET_DEVICES': 'veth0', 'TLS': 'tcp'}
    """
    devices = (net_devices or DEFAULT_NET_DEVICES).strip()
    config = {} if devices == "all" else {"NET_DEVICES": devices}
    tls = (transports or "").strip()
    if tls and tls != "all":
        config["TLS"] = tls
    return config


class TransportClosed(RuntimeError):
    pass


class Transport:
    """One UCX worker and the thread that owns it.

    ``on_message(probe)`` (optional) is called on the transport thread for every
    incoming tagged message, which it must consume with :meth:`recv` or :meth:`discard`.
    ``on_tick(now)`` is called periodically and returns the seconds until it wants the
    next call (``None``: only when idle ticks are due).
    """

    def __init__(self, name: str = "tandem", on_message=None, on_tick=None,
                 idle_tick_s: float = 1.0, ucx_config: dict | None = None):
        self.name = name
        self.on_message, self.on_tick = on_message, on_tick
        self.idle_tick_s = idle_tick_s
        self._config = dict(ucx_config or {})
        self._cmds: collections.deque = collections.deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = False
        self._inflight: dict[object, collections.deque] = {}
        self._endpoints: dict[bytes, object] = {}
        self._watched: dict[bytes, object] = {}
        self._scratch = bytearray(64)
        self._abandoned: list = []
        self._watch_worker = None
        self._workers: list = []
        self.max_discard_bytes = 64 << 20
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address = b""
        self._thread = threading.Thread(target=self._run, name=f"{name}-ucx", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"UCX worker failed to start: {self._error}") from self._error

    # -- any thread ----------------------------------------------------------------------
    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the transport thread, soon."""
        if self._stop:
            raise TransportClosed(f"transport {self.name} is closed")
        self._cmds.append(fn)
        os.eventfd_write(self._wake, 1)

    def call(self, fn: Callable, timeout: float | None = 30.0):
        """Run ``fn()`` on the transport thread and return its result (or raise its error)."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        self.submit(run)
        return fut.result(timeout)

    def wake(self) -> None:
        os.eventfd_write(self._wake, 1)

    def close(self, timeout: float = 5.0) -> None:
        if self._stop:
            return
        self._stop = True
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout)
        os.close(self._wake)

    # -- transport thread only -----------------------------------------------------------
    def endpoint(self, address: bytes):
        """The data endpoint to a peer worker (cached). Raises if UCX cannot reach it."""
        ep = self._endpoints.get(address)
        if ep is None:
            ep = self._worker.create_endpoint_from_worker_address(
                ucx_api.UCXAddress.create_from_buffer(address), False)
            self._endpoints[address] = ep
        return ep

    def watch(self, address: bytes, on_lost: Callable[[bytes], None]):
        """An error-handled endpoint to a peer (cached, on the watch worker), for control
        messages: when the peer dies (or closes) ``on_lost(address)`` runs soon after,
        on this thread."""
        ep = self._watched.get(address)
        if ep is None:
            if self._watch_worker is None:
                self._watch_worker = ucx_api.UCXWorker(self._ctx)
                self._watch_worker.init_blocking_progress_mode()
                self._workers.append(self._watch_worker)
            ep = self._watch_worker.create_endpoint_from_worker_address(
                ucx_api.UCXAddress.create_from_buffer(address), True)
            # UCX calls back from inside progress: only queue the work
            ep.set_close_callback(lambda *_: self._cmds.append(lambda: self._lost(address,
                                                                                 on_lost)))
            self._watched[address] = ep
        return ep

    def _lost(self, address: bytes, on_lost) -> None:
        # dropped, not closed: ucxx 0.50 crashes closing an endpoint that errored
        if self._watched.pop(address, None) is not None:
            on_lost(address)

    def drop_endpoint(self, address: bytes) -> None:
        ep = self._endpoints.pop(address, None)
        if ep is not None:
            self._close_ep(ep)

    @staticmethod
    def _close_ep(ep) -> None:
        try:
            ep.close()
        except Exception as e:  # noqa: BLE001 - closing a dead peer's endpoint
            log.debug("closing endpoint: %s", e)

    def send(self, ep, buf, tag: int, key, on_done: Done) -> None:
        """Tagged send of a contiguous buffer (kept alive until ``on_done``)."""
        req = ep.tag_send(Array(buf), ucx_api.UCXXTag(tag))
        self._track(key, req, buf, on_done)

    def recv(self, probe, buf, key, on_done: Done) -> None:
        """Receive the probed message straight into ``buf``."""
        req = self._worker.tag_recv_with_handle(Array(buf), probe)
        self._track(key, req, buf, on_done)

    def discard(self, probe) -> None:
        """Consume a probed message without keeping it.

        It is received whole into a scratch buffer: a truncated eager receive crashes
        ucxx 0.50, and a truncated rendezvous never completes the sender's request.
        Messages over ``max_discard_bytes`` are truncated anyway (their sender hangs
        until its own timeout, which only a misbehaving peer can cause)."""
        n = probe.length
        if len(self._scratch) < min(n, self.max_discard_bytes):
            self._scratch = bytearray(min(n, self.max_discard_bytes))
        buf = memoryview(self._scratch)[:max(1, min(n, self.max_discard_bytes))]
        req = self._worker.tag_recv_with_handle(Array(buf), probe)
        self._track("discard", req, self._scratch, lambda err: None)

    def tick_soon(self) -> None:
        """Run ``on_tick`` at the next turn of the loop (it may want a shorter period
        now, e.g. a reservation became live)."""
        self._next_tick = 0.0

    def forget(self, key) -> None:
        """Stop tracking a dead peer's requests (they will never complete)."""
        self._inflight.pop(key, None)

    def abandon(self, key) -> int:
        """Stop tracking ``key``'s requests without completing them (their peer is dead
        or gave up); their buffers stay referenced here, so a late completion can never
        touch freed Python memory. Returns how many were abandoned."""
        q = self._inflight.pop(key, None)
        if not q:
            return 0
        self._abandoned.extend((req, buf) for req, buf, _ in q)
        del self._abandoned[:-65536]   # bounded; only page receives (views of the pool's
        return len(q)                  # mapping, never Python memory) are abandoned

    def inflight(self, key) -> int:
        q = self._inflight.get(key)
        return len(q) if q else 0

    def _track(self, key, req, buf, on_done: Done) -> None:
        q = self._inflight.get(key)
        if q is None:
            q = self._inflight[key] = collections.deque()
        q.append((req, buf, on_done))

    def _reap(self) -> bool:
        """Complete finished requests. Each queue is reaped from its head: requests of
        one peer complete in order, so this is linear in completions, not in requests."""
        any_done = False
        for key in list(self._inflight):
            q = self._inflight[key]
            while q and q[0][0].completed:
                req, _buf, on_done = q.popleft()
                any_done = True
                err = None
                try:
                    req.check_error()
                except Exception as e:  # noqa: BLE001 - a failed UCX request
                    err = e
                try:
                    on_done(err)
                except Exception:
                    log.exception("completion callback failed")
            if not q:
                del self._inflight[key]
        return any_done

    def _run(self) -> None:
        try:
            self._ctx = ucx_api.UCXContext(
                self._config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
            self._worker = ucx_api.UCXWorker(self._ctx)
            self._worker.init_blocking_progress_mode()
            self._workers.append(self._worker)
            self.address = bytes(self._worker.address.tobytes())
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._next_tick = time.monotonic()
        try:
            while not self._stop:
                busy = self._run_commands()
                for worker in self._workers:
                    while worker.progress_once():
                        busy = True
                if self.on_message is not None:
                    busy |= self._probe()
                if self._inflight:
                    busy |= self._reap()
                now = time.monotonic()
                if now >= self._next_tick:
                    wanted = None
                    if self.on_tick is not None:
                        try:
                            wanted = self.on_tick(now)
                        except Exception:
                            log.exception("transport tick failed")
                    self._next_tick = now + (self.idle_tick_s if wanted is None else wanted)
                if busy or self._cmds:
                    continue
                if not all(worker.arm() for worker in self._workers):
                    continue
                timeout = max(0.0, self._next_tick - now)
                if self._inflight:
                    # a safety net: some completions raise no epoll event
                    timeout = min(timeout, 0.01)
                fds = [w.epoll_file_descriptor for w in self._workers]
                ready, _, _ = select.select([*fds, self._wake], [], [], timeout)
                if self._wake in ready:
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass
        finally:
            self._shutdown()

    def _run_commands(self) -> bool:
        ran = False
        while self._cmds:
            fn = self._cmds.popleft()
            ran = True
            try:
                fn()
            except Exception:
                log.exception("transport command failed")
        return ran

    def _probe(self) -> bool:
        got = False
        while True:
            probe = self._worker.tag_probe(ucx_api.UCXXTag(0), ucx_api.UCXXTagMask(0),
                                           remove=True)
            if not probe.matched:
                return got
            got = True
            try:
                self.on_message(probe)
            except Exception:
                log.exception("message handler failed; message dropped")
                self.discard(probe)

    def _shutdown(self) -> None:
        for address in list(self._endpoints):
            self.drop_endpoint(address)
        for ep in self._watched.values():
            ep.remove_close_callback()
        self._watched.clear()   # dropped, not closed (see _lost)
        for _ in range(10):
            if not any([w.progress_once() for w in self._workers]):
                break
        self._inflight.clear()


class Messenger:
    """One side of the KV transfer (receiver or sender): owns a :class:`Transport`
    whose thread calls the subclass's ``_on_message`` and ``_on_tick``."""

    _transport: Transport

    def _open(self, name: str, net_devices: str | None = None,
              transports: str | None = None) -> None:
        self._transport = Transport(name, on_message=self._on_message, on_tick=self._on_tick,
                                    ucx_config=ucx_config(net_devices, transports))

    @property
    def address(self) -> bytes:
        """The UCX worker address peers connect to."""
        return self._transport.address

    def close(self) -> None:
        self._transport.close()
