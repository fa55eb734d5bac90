"""What crosses the network: UCX tags and typed, length-checked binary messages.

Nothing received is unpickled or evaluated. A data operation is a bare UCX tagged
message whose 64-bit tag names it; control messages carry a versioned header. Any
parse failure raises :class:`MalformedMessage`, which receivers count and drop.

Tag layout (most significant first)::

    kind:4 | key:32 | op:28

The key is the first 32 bits of the reservation's 128-bit secret (:func:`tag_key`):
a data message names its reservation by something only the holders of the
descriptor know, never by the guessable slot and generation.

>>> t = data_tag(key=0xDEADBEEF, op=1000)
>>> parse_tag(t) == (KIND_DATA, 0xDEADBEEF, 1000)
True
>>> decode_control(encode_control(Nack(5, REFUSED_SECRET, "wrong secret")))
Nack(nonce=5, reason=2, message='wrong secret')
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .plan import DTYPE_SIZES, KV_LAYOUTS, ModelSpec

PROTOCOL_VERSION = 3   # 3: descriptors carry first_page (prefix caching)

KIND_DATA = 1
KIND_CONTROL = 2

KEY_BITS, OP_BITS = 32, 28
KEY_MASK = (1 << KEY_BITS) - 1
MAX_OPS = 1 << OP_BITS
MAX_SLOTS = 1 << 12          # reservation slots a pool may have
SECRET_BYTES = 16            # 128 bits per reservation

MAX_CONTROL_BYTES = 4096


class MalformedMessage(ValueError):
    """Bytes from the network that do not parse; dropped and counted, never trusted."""


def tag_key(secret: bytes) -> int:
    """The data tags' key of a reservation: the first 32 bits of its secret."""
    return int.from_bytes(secret[:4], "little")


def data_tag(key: int, op: int) -> int:
    if not 0 <= key <= KEY_MASK or not 0 <= op < MAX_OPS:
        raise ValueError(f"key {key} or op {op} does not fit the tag")
    return (KIND_DATA << 60) | (key << OP_BITS) | op


def control_tag(channel: int = 0) -> int:
    return (KIND_CONTROL << 60) | (channel & ((1 << 60) - 1))


def parse_tag(tag: int) -> tuple[int, int, int]:
    """``(kind, key, op)``."""
    return tag >> 60, (tag >> OP_BITS) & KEY_MASK, tag & (MAX_OPS - 1)


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


FRAME = struct.Struct("<4sHHI")   # magic, protocol version, kind (or flags), payload length


def frame(magic: bytes, kind: int, payload: bytes) -> bytes:
    """``payload`` behind the header every message of this protocol starts with."""
    return FRAME.pack(magic, PROTOCOL_VERSION, kind, len(payload)) + payload


def unframe(data: bytes, magic: bytes, max_bytes: int, what: str) -> tuple[int, Reader]:
    """Check a message's size, magic, protocol version and length field; returns its
    kind and a reader over the payload.

    >>> unframe(frame(b"TKVX", 3, b"hi"), b"TKVX", 64, "message")[0]
    3
    """
    if len(data) > max_bytes:
        raise MalformedMessage(f"{what} of {len(data)} bytes; allowed: <= {max_bytes}")
    r = Reader(data)
    found, version, kind, length = r.unpack(FRAME.format)
    if found != magic:
        raise MalformedMessage(f"not a {what} (magic {found!r})")
    if version != PROTOCOL_VERSION:
        raise MalformedMessage(f"{what}: protocol version {version}; this side speaks {PROTOCOL_VERSION}")
    if length != len(data) - FRAME.size:
        raise MalformedMessage(f"length field {length} != payload {len(data) - FRAME.size}")
    return kind, r


_DTYPES = tuple(DTYPE_SIZES)


def encode_models(models: tuple[ModelSpec, ...]) -> bytes:
    out = [struct.pack("<B", len(models))]
    for m in models:
        name = m.name.encode()
        out.append(struct.pack("<B", len(name)) + name)
        out.append(struct.pack("<IIIIBBB", m.num_layers, m.num_kv_heads, m.head_dim, m.page_size,
                               _DTYPES.index(m.dtype), KV_LAYOUTS.index(m.kv_layout), m.leader_only))
    return b"".join(out)


def decode_models(r: Reader) -> tuple[ModelSpec, ...]:
    models = []
    for _ in range(r.unpack("<B")[0]):
        name = r.take(r.unpack("<B")[0])
        layers, heads, head_dim, page_size, dt, lay, leader_only = r.unpack("<IIIIBBB")
        if dt >= len(_DTYPES) or lay >= len(KV_LAYOUTS) or leader_only > 1:
            raise MalformedMessage(f"unknown dtype code {dt}, layout code {lay} or flag {leader_only}")
        try:
            models.append(ModelSpec(name.decode(), layers, heads, head_dim, page_size,
                                    _DTYPES[dt], KV_LAYOUTS[lay], bool(leader_only)))
        except (UnicodeDecodeError, ValueError) as e:
            raise MalformedMessage(f"bad model spec: {e}") from None
    return tuple(models)


# -- control messages ------------------------------------------------------------------
_MAGIC = b"TKVM"
OPEN, ACK, NACK, ABORT = 1, 2, 3, 4

# why a receiver refused an Open (Nack.reason)
REFUSED_GONE, REFUSED_SECRET, REFUSED_CLOSING = 1, 2, 3


@dataclass(frozen=True, slots=True)
class Open:
    """Sender -> receiver, once per transfer and sender rank: 'I feed reservation
    (slot, generation); here is its secret; reply to this address'. Data for a
    reservation is accepted only after an Open proved its secret."""
    nonce: int
    reply_address: bytes
    slot: int
    generation: int
    secret: bytes


@dataclass(frozen=True, slots=True)
class Ack:
    """Receiver -> sender: the Open with this nonce is accepted; send the data."""
    nonce: int


@dataclass(frozen=True, slots=True)
class Nack:
    """Receiver -> sender: the Open with this nonce is refused (``reason``: REFUSED_*)."""
    nonce: int
    reason: int
    message: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Receiver -> sender: stop feeding this reservation (cancelled, timed out, failed);
    or sender -> receiver: this prefill gives the reservation up (its prefill failed or
    was aborted), so it fails now rather than at its lease. It carries the secret, so
    only the receiver or a holder of the descriptor can end a transfer."""
    slot: int
    generation: int
    secret: bytes
    reason: int


Control = Open | Ack | Nack | Abort


def encode_control(msg: Control) -> bytes:
    if isinstance(msg, Open):
        _check_secret(msg.secret)
        addr = msg.reply_address
        kind = OPEN
        payload = struct.pack("<QII16sI", msg.nonce, msg.slot, msg.generation, msg.secret,
                              len(addr)) + addr
    elif isinstance(msg, Ack):
        kind, payload = ACK, struct.pack("<Q", msg.nonce)
    elif isinstance(msg, Nack):
        text = msg.message.encode()[:1024]
        kind, payload = NACK, struct.pack("<QIH", msg.nonce, msg.reason, len(text)) + text
    elif isinstance(msg, Abort):
        _check_secret(msg.secret)
        kind = ABORT
        payload = struct.pack("<II16sI", msg.slot, msg.generation, msg.secret, msg.reason)
    else:
        raise TypeError(f"not a control message: {type(msg).__name__}")
    data = frame(_MAGIC, kind, payload)
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    return data


def decode_control(data: bytes) -> Control:
    kind, r = unframe(data, _MAGIC, MAX_CONTROL_BYTES, "control message")
    if kind == OPEN:
        nonce, slot, gen, secret, n = r.unpack("<QII16sI")
        msg = Open(nonce, r.take(n), slot, gen, secret)
    elif kind == ACK:
        msg = Ack(*r.unpack("<Q"))
    elif kind == NACK:
        nonce, reason, n = r.unpack("<QIH")
        try:
            text = r.take(n).decode()
        except UnicodeDecodeError:
            raise MalformedMessage("Nack message is not UTF-8") from None
        msg = Nack(nonce, reason, text)
    elif kind == ABORT:
        msg = Abort(*r.unpack("<II16sI"))
    else:
        raise MalformedMessage(f"unknown control message type {kind}")
    r.done()
    return msg


def _check_secret(secret: bytes) -> None:
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a reservation secret is {SECRET_BYTES} bytes, got {len(secret)}")
