"""The prefill side of the KV transfer: the messenger.

The prefill engine tells the messenger three things, none of which blocks it:

- :meth:`KVSender.begin` — a request's destination descriptor and its source pages;
- :meth:`KVSender.step` — before each forward pass, which requests' chunks it
  computes (up to which token); the returned :class:`ForwardStep` is the per-layer
  counter that the forward advances after each layer (``on_layer_done``);
- :meth:`KVSender.send_context` — after the last chunk, the context blobs
  (penultimate hidden state, logits, ...).

The messenger thread (the UCX transport thread) first opens each transfer with the
receiver (an :class:`~tandem.rdma.wire.Open` that proves the reservation's secret;
data is sent once it is acknowledged), then watches the counter and, as each layer
completes, sends every unit of that layer whose pages are final — while later layers
still compute. A transfer finishes when every one of its sends completed; then
``on_done(transfer)`` runs (on the messenger thread) and the engine may free its pages.
It fails the same way when the receiver refuses the Open (wrong secret, reservation
gone), aborts it (the request was cancelled, or the reservation timed out), or stops
taking data for ``timeout_s``.

:meth:`KVSender.check` holds a descriptor against this rank's own pools before
anything is planned: call it where the descriptor arrives (a request's thread), so
that a forged or mismatched one is refused there, alone.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .descriptor import DestinationDescriptor
from .errors import PeerUnreachable, TransferCancelled, TransferError, TransferTimeout
from .faults import Faults
from .plan import ModelSpec, ShardScheme
from .reservations import FAILURE_REASONS, PREFILL_FAILED
from .transfer import Transfer
from .transport import Messenger
from .wire import (KIND_CONTROL, MAX_CONTROL_BYTES, Abort, Ack, MalformedMessage, Nack, Open,
                   control_tag, data_tag, decode_control, encode_control, parse_tag)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SenderConfig:
    # longer than the receiver's: a live but slow receiver fails (and then drops the
    # late data) before the sender gives up and reuses the pages
    timeout_s: float = 15.0
    connect_timeout_s: float = 5.0
    net_devices: str | None = None   # UCX network devices (transport.ucx_config); None: lo
    transports: str | None = None    # UCX transports (transport.ucx_config); None: UCX's choice
    faults: Faults | None = None     # fault injection (tests, benchmarks)


@dataclass(slots=True)
class SenderStats:
    """Counters since start (read from any thread; written on the messenger thread)."""
    transfers: int = 0       # transfers begun
    failed: int = 0          # ... that failed (refused, aborted, timed out, dropped, send error)
    ops_completed: int = 0   # operations of the transfers that completed
    bytes_sent: int = 0      # ... and their bytes
    staged_ops: int = 0      # operations sent from a staging copy (a gathered run of pages)
    refused: int = 0         # Opens the receiver refused (reservation gone, wrong secret)
    aborted: int = 0         # transfers the decode side ended (cancelled, lease timed out)
    dropped: int = 0         # transfers abandoned by fault injection (drop_sender)


@dataclass(frozen=True, slots=True)
class SourcePool:
    """One prefill rank's KV pool of one model: geometry plus its memory as flat bytes
    (a numpy uint8 array on CPU; a CPU or CUDA uint8 tensor), laid out
    ``[layers, pages, *page_shape]``.

    >>> spec = ModelSpec("target", 2, 2, 8, 4, "float32")
    >>> SourcePool(spec, 2, 3, np.zeros(spec.pool_bytes(2, 3), np.uint8)).layer_bytes
    1536
    """
    spec: ModelSpec      # num_kv_heads is the model's (unsharded) count
    heads: int           # heads this rank holds
    num_pages: int
    data: object

    def __post_init__(self):
        need = self.spec.pool_bytes(self.heads, self.num_pages)
        have = self.data.nbytes if hasattr(self.data, "nbytes") else self.data.numel()
        if have != need:
            raise ValueError(f"source pool {self.spec.name!r} holds {have} bytes; its geometry "
                             f"({self.spec.num_layers} layers x {self.num_pages} pages x "
                             f"{self.page_bytes} bytes) needs {need}")

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes(self.heads)

    @property
    def layer_bytes(self) -> int:
        return self.page_bytes * self.num_pages


def _gather(data, ranges: list[tuple[int, int]]):
    """Copy byte ranges into one contiguous staging buffer."""
    if isinstance(data, np.ndarray):
        out = np.empty(sum(b - a for a, b in ranges), dtype=np.uint8)
        pos = 0
        for a, b in ranges:
            out[pos:pos + b - a] = data[a:b]
            pos += b - a
        return out
    import torch
    return torch.cat([data[a:b] for a, b in ranges])


class ForwardStep:
    """One forward pass of one model, as the messenger sees it: which transfers' chunks
    it computes and a layer counter that the forward advances.

    Pass :meth:`layer_done` as the model runner's ``on_layer_done``.
    """

    def __init__(self, sender: "KVSender", model: str, chunks: dict[Transfer, int]):
        self.sender, self.model, self.chunks = sender, model, chunks
        self.value = 0    # layers completed
        self.seen = 0     # layers the messenger has acted on
        self.computed_at: list[float] = []

    def layer_done(self, layer: int) -> None:
        if layer != self.value:
            raise ValueError(f"layer {layer} done out of order (expected {self.value})")
        self.computed_at.append(time.monotonic())
        self.value = layer + 1
        self.sender._layers_advanced(self)


class _Peer:
    """A receiver this sender feeds: its data endpoint, and the transfers whose Open
    awaits an answer (by nonce). ``state`` turns "ok" at its first answer."""
    __slots__ = ("address", "state", "ep", "opening")

    def __init__(self, address: bytes):
        self.address, self.state, self.ep = address, "connecting", None
        self.opening: dict[int, Transfer] = {}


class KVSender(Messenger):
    """The messenger of one prefill rank.

    ``pools`` maps each model name to this rank's :class:`SourcePool` (an engine's
    page pool is wrapped by its owner, which knows its layout).
    """

    def __init__(self, pools: dict[str, SourcePool], rank: int = 0,
                 scheme: ShardScheme = ShardScheme(1), config: SenderConfig | None = None,
                 name: str = "kv-sender"):
        self.rank, self.scheme, self.config = rank, scheme, config or SenderConfig()
        for n, p in pools.items():
            if not isinstance(p, SourcePool):
                raise TypeError(f"the pool of model {n!r} is a {type(p).__name__}; KVSender "
                                "takes SourcePool (geometry plus flat bytes)")
        self.pools = dict(pools)
        self._names = list(self.pools)
        self._peers: dict[bytes, _Peer] = {}
        self._active: set[Transfer] = set()
        self._faults = self.config.faults
        self.stats = SenderStats()
        self._open(name, self.config.net_devices, self.config.transports)

    # -- any thread ----------------------------------------------------------------------
    def check(self, desc: DestinationDescriptor, context_nbytes: tuple[int, ...] | None = None
              ) -> list[int]:
        """Raise ``ValueError`` unless ``desc`` fits this rank: every model it names is
        one of this rank's pools with the same geometry, it was planned for this
        sender's sharding, and (when given) its context blobs have these sizes. Cheap
        (no plan): call it before accepting a job. Returns the plan's model -> pool
        index."""
        models = []
        for m in desc.models:
            src = self.pools.get(m.name)
            if src is None and m.leader_only and self.rank > 0:
                models.append(-1)   # rank 0 sends it all
                continue
            if src is None:
                raise ValueError(f"no source pool for model {m.name!r}; have {self._names}")
            heads = m.heads_per_rank(self.scheme)
            mine = (src.spec.num_layers, src.heads, src.spec.head_dim, src.spec.page_size,
                    src.spec.itemsize, src.spec.kv_layout)
            theirs = (m.num_layers, heads, m.head_dim, m.page_size, m.itemsize, m.kv_layout)
            if mine != theirs:
                raise ValueError(f"model {m.name!r}: this rank's pool (layers, heads, head_dim, "
                                 f"page_size, itemsize, layout) = {mine}, the destination "
                                 f"expects {theirs}")
            models.append(self._names.index(m.name))
        if desc.src != self.scheme:
            raise ValueError(f"descriptor planned for prefill sharding {desc.src}, this sender "
                             f"is {self.scheme}")
        if context_nbytes is not None and desc.context_nbytes != tuple(context_nbytes):
            raise ValueError(f"descriptor expects context blobs of {desc.context_nbytes} bytes; "
                             f"this prefill sends {tuple(context_nbytes)}")
        return models

    # -- engine thread -------------------------------------------------------------------
    def begin(self, desc: DestinationDescriptor, src_pages,
              on_done: Callable | None = None) -> Transfer:
        """Start a transfer of ``src_pages`` (this rank's page ids, in sequence order)."""
        models = self.check(desc)
        src_pages = [int(p) for p in src_pages]
        if len(src_pages) != len(desc.page_ids):
            raise ValueError(f"{len(src_pages)} source pages for {len(desc.page_ids)} "
                             "destination pages")
        t = Transfer(desc, src_pages, self.rank, models, on_done)
        if t.total == 0:
            # this rank holds only heads another replica set sends, and no context: it has
            # nothing to open (an Open could come after the reservation is complete, and
            # be refused as not live)
            self._transport.submit(lambda: self._finish(t))
            return t
        if self._faults is not None:
            t.drop_after = self._faults.drop_after(t.total)
        self._transport.submit(lambda: self._start(t))
        return t

    def step(self, model: str, chunks: dict[Transfer, int]) -> ForwardStep:
        """Announce a forward pass of ``model`` that computes each transfer's tokens up
        to ``chunks[transfer]`` (exclusive); returns its layer counter."""
        for t, end in chunks.items():
            if model not in t.model_index:
                raise ValueError(f"model {model!r} is not part of this transfer")
            if not 0 < end <= t.desc.num_tokens:
                raise ValueError(f"chunk end {end} outside 1..{t.desc.num_tokens}")
        return ForwardStep(self, model, dict(chunks))

    def send_context(self, t: Transfer, blobs) -> None:
        """Send the context blobs (rank 0 only; other ranks ignore the call)."""
        if t.num_context == 0:
            return
        arrays = [_tensor_bytes(b) if hasattr(b, "numpy") and not isinstance(b, np.ndarray)
                  else np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8).copy()
                  for b in blobs]
        sizes = tuple(a.nbytes for a in arrays)
        if sizes != t.plan.context_nbytes:
            raise ValueError(f"context blob sizes {sizes}; the destination expects "
                             f"{t.plan.context_nbytes}")
        self._transport.submit(lambda: self._context(t, arrays))

    def cancel(self, t: Transfer, why: str) -> None:
        """Stop ``t`` (the engine gave up on it: another rank's transfer of the same
        request failed); it fails with ``why`` unless it ended already. The receiver's
        reservation fails by its lease."""
        self._transport.submit(lambda: self._fail(t, TransferCancelled(why)))

    def give_up(self, desc: DestinationDescriptor) -> None:
        """Tell ``desc``'s receiver that this prefill will send it nothing more (the
        prefill failed or was aborted): the reservation fails now, not at its lease, and
        the decoder recomputes or fails the request at once. Any thread; best effort (a
        receiver that cannot be reached fails the reservation by its lease)."""
        self._transport.submit(lambda: self._give_up(desc))

    def _layers_advanced(self, step: ForwardStep) -> None:
        """``step``'s layer counter advanced (called by :meth:`ForwardStep.layer_done`)."""
        self._transport.submit(lambda: self._on_layers(step))

    # -- messenger thread ----------------------------------------------------------------
    def _start(self, t: Transfer) -> None:
        """Open the transfer: prove the reservation's secret; data waits for the Ack."""
        self.stats.transfers += 1
        self._active.add(t)
        addr = t.desc.worker_address
        peer = self._peers.get(addr)
        if peer is None:
            peer = self._peers[addr] = _Peer(addr)
            try:
                peer.ep = self._transport.endpoint(addr)
                # UCX tells us on this one when the receiver dies: fail at once, not after
                # the stall timeout
                self._transport.watch(addr, self._receiver_lost)
            except Exception as e:  # noqa: BLE001 - UCX cannot reach the address
                return self._peer_failed(peer, PeerUnreachable(
                    f"cannot reach the decode worker: {type(e).__name__}: {e}"))
        t.nonce = random.getrandbits(63)
        t.open_deadline = time.monotonic() + self.config.connect_timeout_s
        peer.opening[t.nonce] = t
        d = t.desc
        try:
            # keyed by the peer, so a dead peer's pending handshake is forgotten with it
            self._transport.send(peer.ep, encode_control(Open(t.nonce, self.address, d.slot,
                                                              d.generation, d.secret)),
                                 control_tag(), addr, lambda err: None)
        except Exception as e:  # noqa: BLE001 - UCX cannot reach the address
            self._peer_failed(peer, PeerUnreachable(
                f"cannot reach the decode worker: {type(e).__name__}: {e}"))

    def _give_up(self, desc: DestinationDescriptor) -> None:
        addr = desc.worker_address
        peer = self._peers.get(addr)
        try:
            ep = peer.ep if peer is not None and peer.ep is not None else self._transport.endpoint(addr)
            self._transport.send(ep, encode_control(Abort(desc.slot, desc.generation, desc.secret, PREFILL_FAILED)),
                                 control_tag(), addr, lambda err: None)
        except Exception as e:  # noqa: BLE001 - the receiver is unreachable: its lease ends it
            log.info("giving up reservation %d/%d: the decode worker is unreachable (%s)", desc.slot,
                     desc.generation, e)

    def _receiver_lost(self, address: bytes) -> None:
        peer = self._peers.get(address)
        if peer is not None:
            self._peer_failed(peer, PeerUnreachable("the decode worker went away (its process "
                                                    "died or closed)"))

    def _peer_failed(self, peer: _Peer, err: Exception) -> None:
        self._peers.pop(peer.address, None)
        self._transport.drop_endpoint(peer.address)
        self._transport.forget(peer.address)
        peer.state = "failed"
        for t in list(peer.opening.values()) + [t for t in self._active
                                                if t.desc.worker_address == peer.address]:
            self._fail(t, err)
        peer.opening = {}

    def _activate(self, t: Transfer) -> None:
        if t.done:
            return
        t.activate()
        for m in range(len(t.plan.models)):
            for layer in range(t.plan.models[m].num_layers):
                self._send_ready(t, m, layer)
        held = t.take_context()
        if held is not None:
            self._context(t, held)
        self._check_done(t)

    def _on_layers(self, step: ForwardStep) -> None:
        value = step.value   # the forward may advance it while we send
        for layer in range(step.seen, value):
            for t, end in step.chunks.items():
                if t.done:
                    continue
                m = t.layer_computed(step.model, layer, end, step.computed_at[layer])
                if t.active:
                    self._send_ready(t, m, layer)
        step.seen = value

    def _send_ready(self, t: Transfer, m: int, layer: int) -> None:
        if t.drop_after is not None and t.sent >= t.drop_after:
            return self._drop(t)
        rows = t.take_ready(m, layer)
        if not rows:
            return
        src = self.pools[self._names[t.source_index[m]]]
        lo = t.plan.layer_ops[m]
        ep = self._peers[t.desc.worker_address].ep
        base = layer * src.layer_bytes
        for row in rows:
            first, npages = int(lo.first[row]), int(lo.npages[row])
            nbytes, off = int(lo.nbytes[row]), int(lo.src_off[row])
            p0 = t.src_pages[first]
            staged = not (npages == 1
                          or t.src_pages[first:first + npages] == list(range(p0, p0 + npages)))
            if not staged:
                a = base + p0 * src.page_bytes + off
                buf = src.data[a:a + nbytes]
            else:   # a run of consecutive destination pages from scattered source pages
                pb = src.page_bytes
                buf = _gather(src.data, [(base + p * pb, base + (p + 1) * pb)
                                         for p in t.src_pages[first:first + npages]])
                self.stats.staged_ops += 1
            self._send(t, ep, buf, t.plan.op_index(m, layer, row), nbytes, staged)
        self._check_done(t)

    def _context(self, t: Transfer, arrays) -> None:
        if t.done:
            return
        if not t.active:
            t.hold_context(arrays)
            return
        ep = self._peers[t.desc.worker_address].ep
        for i, a in enumerate(arrays):
            self._send(t, ep, a, t.plan.context_op(i), a.nbytes)

    def _send(self, t: Transfer, ep, buf, op: int, nbytes: int, staged: bool = False) -> None:
        t.op_posted(nbytes, staged)
        self._transport.send(ep, buf, data_tag(t.desc.tag_key, op),
                             t.desc.worker_address, lambda err: self._sent(t, err))

    def _sent(self, t: Transfer, err) -> None:
        if t.done:
            return
        if err is not None:
            return self._fail(t, TransferError(f"KV send failed: {err}"))
        t.op_completed()
        self._check_done(t)

    def _check_done(self, t: Transfer) -> None:
        if t.done or not t.all_completed:
            return
        self.stats.ops_completed += t.completed
        self.stats.bytes_sent += t.bytes_sent
        self._finish(t)

    def _finish(self, t: Transfer, error: Exception | None = None) -> None:
        self._active.discard(t)
        t.finish(error)
        if t.on_done is not None:
            try:
                t.on_done(t)
            except Exception:
                log.exception("on_done callback failed")

    def _fail(self, t: Transfer, err: Exception) -> None:
        if t.done:
            return
        self.stats.failed += 1
        log.warning("KV transfer to reservation %d/%d failed: %s", t.desc.slot,
                    t.desc.generation, err)
        peer = self._peers.get(t.desc.worker_address)
        if peer is not None:
            peer.opening.pop(getattr(t, "nonce", None), None)
        self._finish(t, err)

    def _drop(self, t: Transfer) -> None:
        """Fault injection: stop feeding ``t`` without a word, as a killed sender would."""
        self.stats.dropped += 1
        self._fail(t, TransferError("a fault was injected (TANDEM_FAULTS drop_sender): the "
                                    "transfer was abandoned half-way"))

    def _on_message(self, probe) -> None:
        kind = parse_tag(probe.sender_tag.value)[0]
        if kind != KIND_CONTROL or probe.length > MAX_CONTROL_BYTES:
            return self._transport.discard(probe)
        buf = bytearray(probe.length)
        self._transport.recv(probe, buf, "control", lambda err: self._on_control(buf, err))

    def _on_control(self, buf, err) -> None:
        try:
            if err is not None:
                raise MalformedMessage(str(err))
            msg = decode_control(bytes(buf))
        except MalformedMessage as e:
            log.info("control message dropped: %s", e)
            return
        if isinstance(msg, (Ack, Nack)):
            self._on_answer(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg)

    def _on_answer(self, msg: Ack | Nack) -> None:
        for peer in self._peers.values():
            t = peer.opening.pop(msg.nonce, None)
            if t is None:
                continue
            peer.state = "ok"
            if isinstance(msg, Ack):
                self._activate(t)
            else:
                self.stats.refused += 1
                self._fail(t, TransferCancelled(f"the decode side refused the transfer: "
                                                f"{msg.message}"))
            return

    def _on_abort(self, msg: Abort) -> None:
        for t in list(self._active):
            d = t.desc
            if (d.slot, d.generation) == (msg.slot, msg.generation) and d.proves(msg.secret):
                self.stats.aborted += 1
                why = FAILURE_REASONS.get(msg.reason, f"error {msg.reason}")
                self._fail(t, TransferCancelled(f"the decode side ended reservation "
                                                f"{d.slot}/{d.generation}: {why}"))

    def _on_tick(self, now: float) -> float | None:
        for peer in list(self._peers.values()):
            if any(now > t.open_deadline for t in peer.opening.values()):
                self._peer_failed(peer, PeerUnreachable(
                    f"the decode worker did not answer the handshake within "
                    f"{self.config.connect_timeout_s}s"))
        for t in list(self._active):
            if t.stalled(now, self.config.timeout_s):
                err = TransferTimeout(
                    f"the receiver took no KV for {self.config.timeout_s}s "
                    f"({t.completed}/{t.total} operations done); pages released")
                peer = self._peers.get(t.desc.worker_address)
                self._fail(t, err)
                if peer is not None:   # its other transfers cannot progress either
                    self._peer_failed(peer, err)
        busy = self._active or any(p.opening for p in self._peers.values())
        return 0.05 if busy else None


def _tensor_bytes(t) -> np.ndarray:
    import torch
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).cpu().numpy().copy()
