"""The decode side of the KV transfer (the kv_transfer process).

:meth:`KVReceiver.reserve` takes a slot and un-evictable pages from the shared pool,
draws the reservation's 128-bit secret, arms the slot's counter with the number of
operations the plan expects, and returns the
:class:`~tandem.rdma.descriptor.DestinationDescriptor` for prefill.

A sender opens the transfer with an :class:`~tandem.rdma.wire.Open` that proves the
secret; only then is data for the reservation taken, and only data whose tag carries
the secret's key. Every arriving data message is checked against that live, opened
reservation — op index in range, not yet received, exact length — and received
straight into its pages (zero-copy for rendezvous messages); anything else is drained
and counted, never written into pages. Completed operations advance the slot's counter
in shared memory; when it reaches the expected count the slot turns READY for the
decode process. No "done" message exists.

Receives are posted when a message is matched, not before it arrives: ucxx 0.50 has no
way to cancel one posted receive, and a pre-posted receive could not be withdrawn
from pages whose reservation was reclaimed. Matching first is what guarantees that a
late message of a reclaimed reservation never lands in a new owner's pages.

A reservation fails when no operation completes for ``timeout_s``, when an operation
fails, when its sender dies (seen on the error-handled watch endpoint to it), or when
the decoder cancels it; its senders are told (:class:`~tandem.rdma.wire.Abort`), and
the decoder sees it failed at once, and its pages are freed once no receive into them
is in flight. Every wait has a
deadline: a receive from a dead sender is given up at once (nothing more can land),
and any receive still in flight ``drain_timeout_s`` after the failure is abandoned.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .descriptor import DestinationDescriptor
from .errors import PoolExhausted
from .faults import Faults
from .plan import ShardScheme, pages_needed
from .reservations import (CANCELLED, FAILED, FAILURE_CODES, INJECTED, PREFILL_FAILED, READY, SENDER_ERROR,
                           TIMEOUT, SlotStatus)
from .shared_pool import SharedKVPool
from .transport import Messenger
from .wire import (KIND_CONTROL, KIND_DATA, MAX_CONTROL_BYTES, MAX_OPS, REFUSED_CLOSING,
                   REFUSED_GONE, REFUSED_SECRET, SECRET_BYTES, Abort, Ack, MalformedMessage, Nack,
                   Open, control_tag, decode_control, encode_control, parse_tag, tag_key)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReceiverConfig:
    timeout_s: float = 10.0        # fail a reservation when no operation completes this long
    claim_lease_s: float = 30.0    # a READY reservation the decoder does not claim is reclaimed
    # runs of consecutive pages travel as one operation of up to this many bytes: per
    # message overhead dominates small pages (64 KiB/op reaches ~1.4 GB/s here, 4 MiB
    # ~6.5 GB/s); a run goes out once all its pages are final, so long runs delay
    # streaming under chunked prefill
    max_run_bytes: int = 4 << 20
    tick_s: float = 0.05           # lease and cancel checks while reservations are live
    # a failed reservation's receives still in flight this long after the failure are
    # abandoned and its pages freed (a dead sender's are given up at once)
    drain_timeout_s: float = 10.0
    net_devices: str | None = None   # UCX network devices (transport.ucx_config); None: lo
    transports: str | None = None    # UCX transports (transport.ucx_config); None: UCX's choice
    faults: Faults | None = None     # fault injection (tests, benchmarks)


@dataclass(slots=True)
class ReceiverStats:
    reservations: int = 0
    ready: int = 0
    failed: int = 0
    cancelled: int = 0           # given up by the decoder
    ops_completed: int = 0
    bytes_received: int = 0
    dropped_stale: int = 0       # for a reservation that is gone (late, reclaimed) or unknown
    dropped_unopened: int = 0    # for a reservation no sender has opened with its secret
    dropped_duplicate: int = 0   # an operation that already arrived
    dropped_malformed: int = 0   # unknown kind, op out of range, wrong length, bad control
    handshakes: int = 0          # Opens accepted
    refused: int = 0             # Opens refused (reservation gone, wrong secret, closing)
    senders_lost: int = 0        # senders seen dying with reservations open
    abandoned_receives: int = 0  # receives given up (dead sender, drain deadline)


@dataclass(slots=True)
class TransferTrace:
    """Timestamps (``time.monotonic()``, comparable across processes on one host)."""
    reserved_at: float
    layer_done_at: dict = field(default_factory=dict)   # (model, layer) -> all its ops done
    ready_at: float | None = None
    failed: int = 0


class _Reservation:
    __slots__ = ("desc", "slot", "gen", "key", "secret", "plan", "received", "completed",
                 "inflight", "deadline", "timeout_s", "failed", "layer_left", "trace", "cols",
                 "bases", "per_layer", "layer_bytes", "page_bytes", "ctx_offsets", "senders",
                 "checkpoint", "doomed", "drain_deadline", "rx_key")

    def __init__(self, desc: DestinationDescriptor, pool: SharedKVPool, timeout_s: float,
                 fail_at: int | None):
        self.desc, self.slot, self.gen = desc, desc.slot, desc.generation
        self.secret, self.key = desc.secret, desc.tag_key
        self.rx_key = ("kv", self.key)     # the transport's in-flight queue of its receives
        self.plan = plan = desc.plan()
        self.received = np.zeros(plan.num_ops, dtype=bool)
        self.completed = self.inflight = self.failed = 0
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.drain_deadline = 0.0
        self.senders: set[bytes] = set()   # reply addresses of the senders that opened it
        # the completed count at which to act: READY at num_ops; an injected fault earlier
        self.doomed = fail_at is not None
        self.checkpoint = plan.num_ops if fail_at is None else fail_at
        self.layer_left = [[len(lo)] * m.num_layers for m, lo in zip(plan.models, plan.layer_ops)]
        self.trace = TransferTrace(time.monotonic())
        # plain lists: per-message lookups without numpy scalar overhead
        self.cols = [(lo.dst_rank.tolist(), lo.first.tolist(), lo.dst_off.tolist(),
                      lo.nbytes.tolist()) for lo in plan.layer_ops]
        self.bases = list(plan.model_base)
        self.per_layer = [len(lo) for lo in plan.layer_ops]
        self.layer_bytes = [pool.layer_bytes(m.name) for m in plan.models]
        self.page_bytes = [pool.page_bytes(m.name) for m in plan.models]
        self.ctx_offsets = [plan.context_offset(i) for i in range(len(plan.context_nbytes))]

    @property
    def opened(self) -> bool:
        return bool(self.senders)

    def locate(self, op: int) -> tuple[int, int, int, int, int]:
        """(model, layer, dst rank, byte offset, nbytes); model -1 is the context."""
        if op >= self.plan.num_kv_ops:
            i = op - self.plan.num_kv_ops
            return -1, i, 0, self.ctx_offsets[i], self.plan.context_nbytes[i]
        m = len(self.bases) - 1
        while self.bases[m] > op:
            m -= 1
        layer, row = divmod(op - self.bases[m], self.per_layer[m])
        dst_rank, first, dst_off, nbytes = (c[row] for c in self.cols[m])
        page = self.desc.page_ids[first]
        offset = layer * self.layer_bytes[m] + page * self.page_bytes[m] + dst_off
        return m, layer, dst_rank, offset, nbytes


class KVReceiver(Messenger):
    """Reservations and receives into a :class:`SharedKVPool` over one UCX worker.

    ``reserve`` may be called from any thread; everything else runs on the transport
    thread.
    """

    def __init__(self, pool: SharedKVPool, config: ReceiverConfig | None = None,
                 name: str = "kv-receiver",
                 on_ready: Callable[[TransferTrace], None] | None = None):
        """``on_ready(trace)`` runs on the transport thread when a reservation's KV has
        all arrived (for metrics: keep it short)."""
        self.pool, self.config = pool, config or ReceiverConfig()
        self._on_ready = on_ready
        self._faults = self.config.faults
        self.stats = ReceiverStats()
        self._live: dict[int, _Reservation] = {}      # by tag key
        self._by_slot: dict[int, _Reservation] = {}
        self._draining: list[_Reservation] = []
        self._senders: dict[bytes, set[_Reservation]] = {}
        self._keys: set[int] = set()                  # tag keys in use (live or draining)
        self._traces: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._closing = False
        self._next_housekeeping = 0.0
        self._open(name, self.config.net_devices, self.config.transports)

    # -- any thread ----------------------------------------------------------------------
    def reserve(self, num_tokens: int, src: ShardScheme = ShardScheme(1),
                context_nbytes=(), seed: int | None = None, max_run_pages: int | None = None,
                timeout_s: float | None = None,
                cached_keys: list[bytes] = ()) -> DestinationDescriptor:
        """Reserve pages for ``num_tokens`` tokens of every model in the pool, fed by a
        prefill sharded as ``src``, plus context blobs of the given sizes. With
        ``cached_keys`` (the prompt's page keys, rooted at :meth:`SharedKVPool.cache_root`)
        the longest prefix decode has cached is shared, not received: the descriptor's
        ``first_page`` says where the transfer starts.

        ``max_run_pages`` (default: from ``config.max_run_bytes``) caps the pages one
        operation carries; 1 is one operation per page and layer. ``timeout_s`` is the
        lease: the reservation fails if no operation completes for that long. Raises
        :class:`PoolExhausted` when the pool has too few free pages or no free slot
        (retry later), ``ValueError`` when the request could never fit."""
        if self._closing:
            raise PoolExhausted("this kv_transfer instance is draining (a newer one serves)")
        spec = self.pool.spec
        if sum(context_nbytes) > spec.context_bytes:
            raise ValueError(f"context of {sum(context_nbytes)} bytes exceeds the pool's "
                             f"{spec.context_bytes} bytes per reservation")
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens}; allowed: >= 1")
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        n_pages = pages_needed(num_tokens, spec.models[0].page_size)
        if n_pages > self.pool.max_reservable_pages():
            raise ValueError(f"{num_tokens} tokens need {n_pages} KV pages; a reservation can "
                             f"hold at most {self.pool.max_reservable_pages()} of the pool's "
                             f"{spec.num_pages}")
        if max_run_pages is None:
            page_bytes = max(self.pool.page_bytes(m.name) for m in spec.models)
            max_run_pages = max(1, self.config.max_run_bytes // page_bytes)
        secret = self._new_secret()
        try:
            slot, gen, pages, shared = self.pool.reserve_prefix(n_pages, cached_keys, 0,
                                                                timeout_s, secret)
        except BaseException:
            self._drop_key(tag_key(secret))
            raise
        try:
            desc = DestinationDescriptor(
                self.address, slot, gen, num_tokens, tuple(pages), spec.models, src, spec.scheme,
                max_run_pages, tuple(context_nbytes),
                secrets.randbits(32) if seed is None else seed, secret, shared)
            if desc.expected_ops >= MAX_OPS:
                raise ValueError(f"{desc.expected_ops} operations exceed the tag's {MAX_OPS}")
            self.pool.arm(slot, gen, desc.expected_ops)
            fail_at = None if self._faults is None else self._faults.transfer_fail_op(
                desc.expected_ops)
            r = _Reservation(desc, self.pool, timeout_s, fail_at)
            self._transport.call(lambda: self._register(r))
        except BaseException:
            self.pool.fail(slot, gen, CANCELLED)
            self._drop_key(tag_key(secret))
            raise
        return desc

    def status(self, slot: int, generation: int) -> SlotStatus:
        return self.pool.poll(slot, generation)

    def wait(self, slot: int, generation: int, timeout: float = 30.0) -> SlotStatus:
        """Poll until the reservation is READY or FAILED (tests and tools)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.pool.poll(slot, generation)
            if st.state in (READY, FAILED) or time.monotonic() > deadline:
                return st
            time.sleep(0.002)

    def trace(self, slot: int, generation: int) -> TransferTrace | None:
        with self._lock:
            return self._traces.get((slot, generation))

    def cancel(self, slot: int, generation: int) -> None:
        self._transport.call(lambda: self._cancel(slot, generation))

    def drain(self, timeout_s: float) -> bool:
        """Stop reserving and wait (at most ``timeout_s``) until every reservation this
        receiver made has ended: READY and claimed, or failed and its pages freed. For a
        version roll: the old instance drains while the new one serves. Whether it
        drained."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = self._transport.call(lambda: bool(self._live or self._draining))
            if not busy and not self.pool.owned_reservations():
                return True
            time.sleep(0.02)
        return False

    # -- secrets and keys ----------------------------------------------------------------
    def _new_secret(self) -> bytes:
        """A fresh 128-bit secret whose tag key no reservation of this receiver uses."""
        with self._lock:
            while True:
                secret = secrets.token_bytes(SECRET_BYTES)
                key = tag_key(secret)
                if key not in self._keys:
                    self._keys.add(key)
                    return secret

    def _drop_key(self, key: int) -> None:
        with self._lock:
            self._keys.discard(key)

    # -- transport thread ----------------------------------------------------------------
    def _register(self, r: _Reservation) -> None:
        self._live[r.key] = r
        self._by_slot[r.slot] = r
        self.stats.reservations += 1
        self._transport.tick_soon()   # lease and cancel checks start now
        with self._lock:
            self._traces[(r.slot, r.gen)] = r.trace
            while len(self._traces) > 4096:
                self._traces.popitem(last=False)

    def _cancel(self, slot: int, gen: int) -> None:
        r = self._by_slot.get(slot)
        if r is not None and r.gen == gen:
            self._fail(r, CANCELLED)

    def _on_message(self, probe) -> None:
        kind, key, op = parse_tag(probe.sender_tag.value)
        if kind == KIND_CONTROL:
            return self._on_control(probe)
        if kind != KIND_DATA:
            return self._drop(probe, "dropped_malformed")
        r = self._live.get(key)
        if r is None:
            return self._drop(probe, "dropped_stale")
        if not r.senders:
            return self._drop(probe, "dropped_unopened")
        if op >= len(r.received):
            return self._drop(probe, "dropped_malformed")
        if r.received[op]:
            return self._drop(probe, "dropped_duplicate")
        model, layer, dst_rank, offset, nbytes = r.locate(op)
        if probe.length != nbytes:
            return self._drop(probe, "dropped_malformed")
        if model < 0:
            dst = self.pool.context(r.slot)[offset:offset + nbytes]
        else:
            dst = self.pool.kv(dst_rank, r.plan.models[model].name)[offset:offset + nbytes]
        r.received[op] = True
        r.inflight += 1
        self._transport.recv(probe, dst, r.rx_key,
                             lambda err: self._op_done(r, op, model, layer, nbytes, err))

    def _drop(self, probe, counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self._transport.discard(probe)

    def _op_done(self, r: _Reservation, op: int, model: int, layer: int, nbytes: int,
                 err: Exception | None) -> None:
        r.inflight -= 1
        if r.failed:
            if r.inflight == 0:
                self._release(r)
            return
        if err is not None:
            log.warning("KV receive for reservation %d/%d failed: %s", r.slot, r.gen, err)
            return self._fail(r, SENDER_ERROR)
        now = time.monotonic()
        r.completed += 1
        r.deadline = now + r.timeout_s    # the lease renews with progress
        self.pool.add_completed(r.slot)
        self.stats.ops_completed += 1
        self.stats.bytes_received += nbytes
        if model >= 0:
            left = r.layer_left[model]
            left[layer] -= 1
            if left[layer] == 0:
                r.trace.layer_done_at[(r.plan.models[model].name, layer)] = now
        if r.completed >= r.checkpoint:
            self._checkpoint(r, now)

    def _checkpoint(self, r: _Reservation, now: float) -> None:
        if r.doomed:
            return self._fail(r, INJECTED)
        self._unregister(r)
        if self.pool.mark_ready(r.slot, r.gen, self.config.claim_lease_s):
            r.trace.ready_at = now
            self.stats.ready += 1
            if self._on_ready is not None:
                try:
                    self._on_ready(r.trace)
                except Exception:
                    log.exception("on_ready callback failed")
        elif self.pool.poll(r.slot, r.gen).error == CANCELLED:   # cancelled as it completed
            r.failed = r.trace.failed = CANCELLED
            self.stats.failed += 1
            self.stats.cancelled += 1
        self._forget_senders(r)
        self._drop_key(r.key)

    def _unregister(self, r: _Reservation) -> None:
        self._live.pop(r.key, None)
        if self._by_slot.get(r.slot) is r:
            del self._by_slot[r.slot]

    def _fail(self, r: _Reservation, reason: int) -> None:
        """Stop accepting messages for ``r``, tell its senders; free its pages once no
        receive is in flight (or at its drain deadline)."""
        if r.failed:
            return
        r.failed = r.trace.failed = reason
        self._unregister(r)
        self.stats.failed += 1
        self.stats.cancelled += reason == CANCELLED
        for address in r.senders:
            self._tell(address, Abort(r.slot, r.gen, r.secret, reason))
        if r.inflight == 0:
            self._release(r)
        else:   # the decoder learns now; the pages wait for the receives (or their deadline)
            self.pool.doom(r.slot, r.gen, reason)
            r.drain_deadline = time.monotonic() + self.config.drain_timeout_s
            self._draining.append(r)

    def _release(self, r: _Reservation) -> None:
        self.pool.fail(r.slot, r.gen, r.failed)
        if r in self._draining:
            self._draining.remove(r)
        self._forget_senders(r)
        self._drop_key(r.key)

    def _abandon(self, r: _Reservation, why: str) -> None:
        """Give up ``r``'s receives in flight (their sender is dead or gone for good) and
        free its pages."""
        n = self._transport.abandon(r.rx_key)
        self.stats.abandoned_receives += n
        log.warning("reservation %d/%d: %d receive(s) given up (%s); pages freed", r.slot,
                    r.gen, n, why)
        r.inflight = 0
        self._release(r)

    def _forget_senders(self, r: _Reservation) -> None:
        for address in r.senders:
            fed = self._senders.get(address)
            if fed is not None:
                fed.discard(r)

    def _tell(self, address: bytes, msg) -> None:
        try:
            ep = self._transport.watch(address, self._sender_lost)
            self._transport.send(ep, encode_control(msg), control_tag(), "control",
                                 lambda err: None)
        except Exception as e:  # noqa: BLE001 - a peer we cannot reach: its loss shows
            log.info("control message to a sender not sent: %s", e)

    def _sender_lost(self, address: bytes) -> None:
        """A sender died (or closed): its reservations fail; a reservation none of whose
        senders is left can receive nothing more, so its receives are given up now."""
        fed = self._senders.pop(address, set())
        if fed:
            self.stats.senders_lost += 1
        for r in list(fed):
            r.senders.discard(address)
            if not r.failed:
                log.warning("reservation %d/%d: its sender went away", r.slot, r.gen)
                self._fail(r, SENDER_ERROR)
            if r.inflight and not r.senders and r in self._draining:
                self._abandon(r, "its sender died")

    # -- control -------------------------------------------------------------------------
    def _on_control(self, probe) -> None:
        if probe.length > MAX_CONTROL_BYTES:
            return self._drop(probe, "dropped_malformed")
        buf = bytearray(probe.length)
        self._transport.recv(probe, buf, "control", lambda err: self._control_done(buf, err))

    def _control_done(self, buf: bytearray, err) -> None:
        try:
            if err is not None:
                raise MalformedMessage(str(err))
            msg = decode_control(bytes(buf))
            if isinstance(msg, Abort):
                return self._on_given_up(msg)
            if not isinstance(msg, Open):
                raise MalformedMessage(f"unexpected {type(msg).__name__}")
            self._on_open(msg)
        except Exception as e:  # noqa: BLE001 - anything wrong with a peer's message
            log.info("control message dropped: %s", e)
            self.stats.dropped_malformed += 1

    def _on_open(self, msg: Open) -> None:
        r = self._by_slot.get(msg.slot)
        refusal = None
        if self._closing and r is None:
            refusal = (REFUSED_CLOSING, "this kv_transfer instance is draining")
        elif r is None or r.gen != msg.generation:
            st = self.pool.poll(msg.slot, msg.generation)
            why = FAILURE_CODES.get(st.error, "gone") if st.failed else "not live"
            refusal = (REFUSED_GONE, f"reservation {msg.slot}/{msg.generation} is not live "
                                     f"here ({why})")
        elif not hmac.compare_digest(r.secret, msg.secret):
            refusal = (REFUSED_SECRET, f"reservation {msg.slot}/{msg.generation}: wrong secret")
        ep = self._transport.watch(msg.reply_address, self._sender_lost)   # raises if bogus
        if refusal is not None:
            self.stats.refused += 1
            log.info("transfer refused: %s", refusal[1])
            self._transport.send(ep, encode_control(Nack(msg.nonce, *refusal)), control_tag(),
                                 "control", lambda err: None)
            return
        if r.doomed and r.checkpoint == 0:      # injected before the first layer
            self._transport.send(ep, encode_control(Nack(msg.nonce, REFUSED_GONE,
                                                         "a fault was injected (TANDEM_FAULTS)")),
                                 control_tag(), "control", lambda err: None)
            return self._fail(r, INJECTED)
        r.senders.add(msg.reply_address)
        self._senders.setdefault(msg.reply_address, set()).add(r)
        self.stats.handshakes += 1
        self._transport.send(ep, encode_control(Ack(msg.nonce)), control_tag(), "control",
                             lambda err: None)

    def _on_given_up(self, msg: Abort) -> None:
        """A prefill will send this reservation nothing more: fail it now (its other
        senders are told), so the decoder recomputes or fails the request at once."""
        r = self._by_slot.get(msg.slot)
        if r is None or r.gen != msg.generation or not hmac.compare_digest(r.secret, msg.secret):
            log.info("a give-up for reservation %d/%d dropped: not live here, or the wrong secret",
                     msg.slot, msg.generation)
            return
        log.info("reservation %d/%d: the prefill side gave it up", r.slot, r.gen)
        self._fail(r, PREFILL_FAILED)

    def _on_tick(self, now: float) -> float | None:
        for r in list(self._live.values()):
            if now > r.deadline:
                log.warning("KV transfer for reservation %d/%d timed out: %d of %d operations "
                            "completed", r.slot, r.gen, r.completed, r.plan.num_ops)
                self._fail(r, TIMEOUT)
            elif self.pool.cancel_requested(r.slot, r.gen):
                self._fail(r, CANCELLED)
        for r in list(self._draining):
            if now > r.drain_deadline:
                self._abandon(r, f"still in flight {self.config.drain_timeout_s}s after the "
                                 "reservation failed")
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + 1.0
            try:
                self.pool.housekeep(now)
            except Exception:
                log.exception("pool housekeeping failed")
        return self.config.tick_s if (self._live or self._draining) else None


__all__ = ["KVReceiver", "ReceiverConfig", "ReceiverStats", "TransferTrace", "PoolExhausted"]
