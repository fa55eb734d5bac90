"""The destination descriptor: the one object kv_transfer hands to prefill.

It says where the KV goes (the receiver's UCX worker address, the reservation's slot,
generation and 128-bit secret, the destination page ids) — from ``first_page`` on: the
pages before it decode holds already, from its prefix cache — and everything both sides
need to derive the same :class:`~tandem.rdma.plan.TransferPlan` (model geometry, both
sharding schemes, run cap, context sizes, replica seed). It travels as bytes (a Triton
tensor, or gRPC to a remote prefill server) with a versioned, length-checked encoding.

Whoever receives one treats it as hostile until checked: :meth:`~DestinationDescriptor.from_bytes`
bounds every count and computes the plan's size in closed form (O(bytes), whatever the
page size it claims) before anything is planned; :func:`check_for_pool` (decode) and
the sender's :meth:`~tandem.rdma.sender.KVSender.check` (prefill) then hold it against
the geometry they know. The plan itself is built only when a transfer starts.

>>> from tandem.rdma.plan import ModelSpec, ShardScheme
>>> d = DestinationDescriptor(b"addr", slot=1, generation=2, num_tokens=20,
...     page_ids=(7, 8), models=(ModelSpec("target", 2, 8, 64, 16),),
...     src=ShardScheme(1), dst=ShardScheme(1), secret=bytes(range(16)))
>>> DestinationDescriptor.from_bytes(d.to_bytes()) == d
True
>>> d.expected_ops    # one op per page and layer by default: 2 pages x 2 layers
4
"""
from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass, field

import numpy as np

from .plan import (ModelSpec, ShardScheme, TransferPlan, count_ops, num_page_pieces, pages_needed,
                   plan_transfer, shard_pairs)
from .wire import (MAX_OPS, SECRET_BYTES, MalformedMessage, decode_models,
                   encode_models, frame, tag_key, unframe)

_MAGIC = b"TKVD"
_FIXED = struct.Struct(f"<IIIHHHHIQQBII{SECRET_BYTES}sI")


@dataclass(frozen=True, slots=True)
class DescriptorLimits:
    """Absolute caps on what a descriptor may ask for, checked before any plan exists
    (a receiver that knows the real geometry checks that too). Far above any real
    deployment; what they bound is the work and memory a forged descriptor can cause."""
    max_bytes: int = 8 << 20
    max_pages: int = 1 << 20
    max_models: int = 8
    max_layers: int = 4096
    max_tp: int = 64
    max_context_blobs: int = 16
    max_address_bytes: int = 1 << 16
    max_pieces_per_page: int = 1 << 12   # contiguous pieces one rank pair moves per page
    max_layer_ops: int = 1 << 20         # plan rows per model and layer
    max_ops: int = 1 << 24               # operations of the whole transfer (< the tag's 2^28)


LIMITS = DescriptorLimits()


@dataclass(frozen=True, slots=True)
class DestinationDescriptor:
    worker_address: bytes
    slot: int
    generation: int
    num_tokens: int
    page_ids: tuple[int, ...]
    models: tuple[ModelSpec, ...]
    src: ShardScheme
    dst: ShardScheme
    max_run_pages: int = 1
    context_nbytes: tuple[int, ...] = ()
    seed: int = 0
    secret: bytes = bytes(SECRET_BYTES)
    # the sequence's pages before this one decode holds already (its prefix cache):
    # ``page_ids[j]`` receives sequence page ``first_page + j``
    first_page: int = 0
    _plan: TransferPlan | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "page_ids", tuple(int(p) for p in self.page_ids))
        object.__setattr__(self, "context_nbytes", tuple(int(n) for n in self.context_nbytes))
        object.__setattr__(self, "models", tuple(self.models))
        if len(self.secret) != SECRET_BYTES:
            raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(self.secret)}")

    def __repr__(self) -> str:   # never print the secret
        return (f"DestinationDescriptor(slot={self.slot}, generation={self.generation}, "
                f"num_tokens={self.num_tokens}, pages={len(self.page_ids)}, "
                f"first_page={self.first_page}, "
                f"models={[m.name for m in self.models]}, src={self.src}, dst={self.dst})")

    @property
    def tag_key(self) -> int:
        """The key this reservation's data messages carry in their tags."""
        return tag_key(self.secret)

    @property
    def first_token(self) -> int:
        """The first token whose KV this transfer carries."""
        return self.first_page * self.models[0].page_size

    def plan(self) -> TransferPlan:
        """The transfer plan (computed once per descriptor)."""
        if self._plan is None:
            object.__setattr__(self, "_plan", plan_transfer(
                self.models, self.page_ids, self.num_tokens - self.first_token, self.src,
                self.dst, self.max_run_pages, self.context_nbytes, self.seed))
        return self._plan

    @property
    def expected_ops(self) -> int:
        """Operations the receiver's counter expects: KV ops of every rank + context blobs."""
        if self._plan is not None:
            return self._plan.num_ops
        return count_ops(self.models, self.page_ids, self.src, self.dst, self.max_run_pages,
                         len(self.context_nbytes), self.seed)[0]

    def proves(self, secret: bytes) -> bool:
        """Whether ``secret`` is this reservation's (constant time)."""
        return hmac.compare_digest(self.secret, secret)

    def to_bytes(self) -> bytes:
        body = b"".join([
            _FIXED.pack(self.slot, self.generation, self.num_tokens, self.src.tp_size,
                        self.src.replica_sets, self.dst.tp_size, self.dst.replica_sets,
                        self.max_run_pages, self.seed, self.expected_ops,
                        len(self.context_nbytes), len(self.page_ids), len(self.worker_address),
                        self.secret, self.first_page),
            encode_models(self.models),
            np.asarray(self.context_nbytes, dtype="<u8").tobytes(),
            np.asarray(self.page_ids, dtype="<u4").tobytes(),
            self.worker_address,
        ])
        return frame(_MAGIC, 0, body)

    @classmethod
    def from_bytes(cls, data: bytes, limits: DescriptorLimits = LIMITS) -> "DestinationDescriptor":
        """Parse and validate; raises :class:`MalformedMessage` on anything inconsistent
        or over ``limits``. Costs O(len(data)): no plan is built."""
        _flags, r = unframe(data, _MAGIC, limits.max_bytes, "destination descriptor")
        (slot, gen, num_tokens, s_tp, s_sets, d_tp, d_sets, max_run, seed, expected, n_ctx,
         n_pages, n_addr, secret, first_page) = r.unpack(_FIXED.format)
        _at_most("pages", n_pages, limits.max_pages)
        _at_most("context blobs", n_ctx, limits.max_context_blobs)
        _at_most("worker address bytes", n_addr, limits.max_address_bytes)
        _at_most("source tp_size", s_tp, limits.max_tp)
        _at_most("destination tp_size", d_tp, limits.max_tp)
        models = decode_models(r)
        _at_most("models", len(models), limits.max_models)
        for m in models:
            _at_most(f"layers of {m.name!r}", m.num_layers, limits.max_layers)
        ctx = tuple(int(x) for x in np.frombuffer(r.take(8 * n_ctx), dtype="<u8"))
        pages = np.frombuffer(r.take(4 * n_pages), dtype="<u4")
        addr = r.take(n_addr)
        r.done()
        try:
            src, dst = ShardScheme(s_tp, s_sets), ShardScheme(d_tp, d_sets)
            if not models:
                raise ValueError("a transfer needs at least one model")
            if len({m.page_size for m in models}) != 1:
                raise ValueError("all models of a transfer share one page_size")
            if (num_tokens < 1 or n_pages < 1 or pages_needed(num_tokens, models[0].page_size)
                    != first_page + n_pages):
                raise ValueError(f"{num_tokens} tokens do not fill {n_pages} pages of "
                                 f"{models[0].page_size} tokens after page {first_page}")
            if len(np.unique(pages)) != n_pages:
                raise ValueError("a page id is listed twice")
            if max_run < 1 or any(n < 1 for n in ctx):
                raise ValueError("max_run_pages and context blob sizes must be >= 1")
            for m in models:     # raise if a scheme cannot split the model's heads
                m.heads_per_rank(src), m.heads_per_rank(dst)
            _check_pieces(models, src, dst, seed, limits)
            total, widest = count_ops(models, pages, src, dst, max_run, n_ctx, seed)
        except MalformedMessage:
            raise
        except ValueError as e:
            raise MalformedMessage(f"inconsistent descriptor: {e}") from None
        _at_most("operations per layer", widest, limits.max_layer_ops)
        _at_most("operations", total, min(limits.max_ops, MAX_OPS - 1))
        if total != expected:
            raise MalformedMessage(f"descriptor expects {expected} operations, its plan has "
                                   f"{total} (version skew?)")
        return cls(addr, slot, gen, num_tokens, tuple(pages.tolist()), models, src, dst,
                   max_run, ctx, seed, secret, first_page)


def check_for_pool(desc: DestinationDescriptor, spec) -> None:
    """Hold ``desc`` against the pool it claims to point into (``spec``: a
    :class:`~tandem.rdma.pool_layout.PoolSpec`): slot and page ids in range, the pool's
    models, sharding and context sizes. Raises :class:`MalformedMessage` naming the
    first mismatch. Costs O(pages)."""
    if not 0 <= desc.slot < spec.num_slots:
        raise MalformedMessage(f"slot {desc.slot} out of range 0..{spec.num_slots - 1}")
    if desc.models != spec.models:
        raise MalformedMessage(f"the descriptor's models {[m.name for m in desc.models]} (or "
                               "their geometry) are not this pool's")
    if desc.dst != spec.scheme:
        raise MalformedMessage(f"destination sharding {desc.dst}; this pool is {spec.scheme}")
    if desc.page_ids and max(desc.page_ids) >= spec.num_pages:
        raise MalformedMessage(f"page id {max(desc.page_ids)} out of range 0.."
                               f"{spec.num_pages - 1}")
    if sum(desc.context_nbytes) > spec.context_bytes:
        raise MalformedMessage(f"context of {sum(desc.context_nbytes)} bytes exceeds the pool's "
                               f"{spec.context_bytes}")


def _check_pieces(models, src: ShardScheme, dst: ShardScheme, seed: int,
                  limits: DescriptorLimits) -> None:
    for m in models:
        s, d = m.split(src), m.split(dst)
        for pair in shard_pairs(s, d, m.num_kv_heads, seed):
            n = num_page_pieces(m.kv_layout, s.head_range(pair.src_rank, m.num_kv_heads),
                                d.head_range(pair.dst_rank, m.num_kv_heads), pair.heads,
                                m.page_size, m.head_dim)
            _at_most(f"pieces per page of {m.name!r}", n, limits.max_pieces_per_page)


def _at_most(what: str, value: int, cap: int) -> None:
    if value > cap:
        raise MalformedMessage(f"descriptor asks for {value} {what}; allowed: <= {cap}")
