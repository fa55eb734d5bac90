"""The destination descriptor: the one object kv_transfer hands to prefill.

It says where the KV goes (the receiver's UCX worker address, the reservation's slot
and generation, the destination page ids) and everything both sides need to derive
the same :class:`~tandem.rdma.plan.TransferPlan` (model geometry, both sharding
schemes, run cap, context sizes, replica seed). It travels as bytes (a Triton tensor,
or gRPC to a remote prefill server) with a versioned, length-checked encoding.

>>> from tandem.rdma.plan import ModelSpec, ShardScheme
>>> d = DestinationDescriptor(b"addr", slot=1, generation=2, num_tokens=20,
...     page_ids=(7, 8), models=(ModelSpec("target", 2, 8, 64, 16),),
...     src=ShardScheme(1), dst=ShardScheme(1))
>>> DestinationDescriptor.from_bytes(d.to_bytes()) == d
True
>>> d.expected_ops    # one op per page and layer by default: 2 pages x 2 layers
4
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from .plan import ModelSpec, ShardScheme, TransferPlan, plan_transfer
from .wire import PROTOCOL_VERSION, MalformedMessage, Reader, decode_models, encode_models

_MAGIC = b"TKVD"
_HEAD = struct.Struct("<4sHHI")
_FIXED = struct.Struct("<IIIHHHHIQQBII")


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
    _plan: TransferPlan | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "page_ids", tuple(int(p) for p in self.page_ids))
        object.__setattr__(self, "context_nbytes", tuple(int(n) for n in self.context_nbytes))
        object.__setattr__(self, "models", tuple(self.models))

    def plan(self) -> TransferPlan:
        """The transfer plan (computed once per descriptor)."""
        if self._plan is None:
            object.__setattr__(self, "_plan", plan_transfer(
                self.models, self.page_ids, self.num_tokens, self.src, self.dst,
                self.max_run_pages, self.context_nbytes, self.seed))
        return self._plan

    @property
    def expected_ops(self) -> int:
        """Operations the receiver's counter expects: KV ops of every rank + context blobs."""
        return self.plan().num_ops

    def to_bytes(self) -> bytes:
        body = b"".join([
            _FIXED.pack(self.slot, self.generation, self.num_tokens, self.src.tp_size,
                        self.src.replica_sets, self.dst.tp_size, self.dst.replica_sets,
                        self.max_run_pages, self.seed, self.expected_ops,
                        len(self.context_nbytes), len(self.page_ids), len(self.worker_address)),
            encode_models(self.models),
            np.asarray(self.context_nbytes, dtype="<u8").tobytes(),
            np.asarray(self.page_ids, dtype="<u4").tobytes(),
            self.worker_address,
        ])
        return _HEAD.pack(_MAGIC, PROTOCOL_VERSION, 0, len(body)) + body

    @classmethod
    def from_bytes(cls, data: bytes) -> "DestinationDescriptor":
        """Parse and validate; raises :class:`MalformedMessage` on anything inconsistent."""
        r = Reader(data)
        magic, version, _flags, length = r.unpack(_HEAD.format)
        if magic != _MAGIC:
            raise MalformedMessage(f"not a destination descriptor (magic {magic!r})")
        if version != PROTOCOL_VERSION:
            raise MalformedMessage(f"descriptor version {version}; this side speaks "
                                   f"{PROTOCOL_VERSION}")
        if length != len(data) - _HEAD.size:
            raise MalformedMessage(f"length field {length} != body {len(data) - _HEAD.size}")
        (slot, gen, num_tokens, s_tp, s_sets, d_tp, d_sets, max_run, seed, expected, n_ctx,
         n_pages, n_addr) = r.unpack(_FIXED.format)
        models = decode_models(r)
        ctx = tuple(int(x) for x in np.frombuffer(r.take(8 * n_ctx), dtype="<u8"))
        pages = tuple(int(x) for x in np.frombuffer(r.take(4 * n_pages), dtype="<u4"))
        addr = r.take(n_addr)
        r.done()
        try:
            d = cls(addr, slot, gen, num_tokens, pages, models, ShardScheme(s_tp, s_sets),
                    ShardScheme(d_tp, d_sets), max_run, ctx, seed)
            ok = d.expected_ops == expected
        except ValueError as e:
            raise MalformedMessage(f"inconsistent descriptor: {e}") from None
        if not ok:
            raise MalformedMessage(f"descriptor expects {expected} operations, its plan has "
                                   f"{d.expected_ops} (version skew?)")
        return d
