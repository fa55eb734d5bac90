"""What crosses the network: UCX tags and typed, length-checked binary messages.

Nothing received is unpickled or evaluated. A data operation is a bare UCX tagged
message whose 64-bit tag names it; control messages carry a versioned header. Any
parse failure raises :class:`MalformedMessage`, which receivers count and drop.

Tag layout (most significant first)::

    kind:4 | slot:12 | generation:20 | op:28

>>> t = data_tag(slot=3, generation=77, op=1000)
>>> parse_tag(t)
(1, 3, 77, 1000)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .plan import DTYPE_SIZES, KV_LAYOUTS, ModelSpec

PROTOCOL_VERSION = 1

KIND_DATA = 1
KIND_CONTROL = 2

SLOT_BITS, GEN_BITS, OP_BITS = 12, 20, 28
MAX_SLOTS = 1 << SLOT_BITS
GEN_MASK = (1 << GEN_BITS) - 1
MAX_OPS = 1 << OP_BITS

MAX_CONTROL_BYTES = 4096


class MalformedMessage(ValueError):
    """Bytes from the network that do not parse; dropped and counted, never trusted."""


def data_tag(slot: int, generation: int, op: int) -> int:
    if not 0 <= slot < MAX_SLOTS or not 0 <= op < MAX_OPS:
        raise ValueError(f"slot {slot} or op {op} does not fit the tag")
    return ((KIND_DATA << 60) | (slot << (GEN_BITS + OP_BITS))
            | ((generation & GEN_MASK) << OP_BITS) | op)


def control_tag(channel: int = 0) -> int:
    return (KIND_CONTROL << 60) | (channel & ((1 << 60) - 1))


def parse_tag(tag: int) -> tuple[int, int, int, int]:
    """``(kind, slot, generation & GEN_MASK, op)``."""
    return (tag >> 60, (tag >> (GEN_BITS + OP_BITS)) & (MAX_SLOTS - 1),
            (tag >> OP_BITS) & GEN_MASK, tag & (MAX_OPS - 1))


class Reader:
    """Bounds-checked reads from a byte string."""

    def __init__(self, data: bytes):
        self.data, self.pos = bytes(data), 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise MalformedMessage(f"truncated: need {n} bytes at {self.pos}, have "
                                   f"{len(self.data) - self.pos}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def done(self) -> None:
        if self.pos != len(self.data):
            raise MalformedMessage(f"{len(self.data) - self.pos} trailing bytes")


_DTYPES = tuple(DTYPE_SIZES)


def encode_models(models: tuple[ModelSpec, ...]) -> bytes:
    out = [struct.pack("<B", len(models))]
    for m in models:
        name = m.name.encode()
        out.append(struct.pack("<B", len(name)) + name)
        out.append(struct.pack("<IIIIBB", m.num_layers, m.num_kv_heads, m.head_dim, m.page_size,
                               _DTYPES.index(m.dtype), KV_LAYOUTS.index(m.kv_layout)))
    return b"".join(out)


def decode_models(r: Reader) -> tuple[ModelSpec, ...]:
    models = []
    for _ in range(r.unpack("<B")[0]):
        name = r.take(r.unpack("<B")[0])
        layers, heads, head_dim, page_size, dt, lay = r.unpack("<IIIIBB")
        if dt >= len(_DTYPES) or lay >= len(KV_LAYOUTS):
            raise MalformedMessage(f"unknown dtype code {dt} or layout code {lay}")
        try:
            models.append(ModelSpec(name.decode(), layers, heads, head_dim, page_size,
                                    _DTYPES[dt], KV_LAYOUTS[lay]))
        except (UnicodeDecodeError, ValueError) as e:
            raise MalformedMessage(f"bad model spec: {e}") from None
    return tuple(models)


# -- control messages ------------------------------------------------------------------
_HEADER = struct.Struct("<4sHHI")   # magic, version, type, payload length
_MAGIC = b"TKVM"
HELLO, ACK = 1, 2


@dataclass(frozen=True, slots=True)
class Hello:
    """Sender -> receiver: 'reply to this address' (checks reachability and version)."""
    nonce: int
    reply_address: bytes


@dataclass(frozen=True, slots=True)
class Ack:
    nonce: int


def encode_control(msg: Hello | Ack) -> bytes:
    if isinstance(msg, Hello):
        addr = msg.reply_address
        kind, payload = HELLO, struct.pack("<QI", msg.nonce, len(addr)) + addr
    else:
        kind, payload = ACK, struct.pack("<Q", msg.nonce)
    data = _HEADER.pack(_MAGIC, PROTOCOL_VERSION, kind, len(payload)) + payload
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    return data


def decode_control(data: bytes) -> Hello | Ack:
    r = Reader(data)
    magic, version, kind, length = r.unpack(_HEADER.format)
    if magic != _MAGIC:
        raise MalformedMessage(f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    if length != len(data) - _HEADER.size:
        raise MalformedMessage(f"length field {length} != payload {len(data) - _HEADER.size}")
    if kind == HELLO:
        nonce, n = r.unpack("<QI")
        msg = Hello(nonce, r.take(n))
    elif kind == ACK:
        msg = Ack(*r.unpack("<Q"))
    else:
        raise MalformedMessage(f"unknown control message type {kind}")
    r.done()
    return msg
