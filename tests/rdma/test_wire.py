"""What crosses the network parses strictly: round trips are exact, and any corrupted,
truncated or foreign bytes raise MalformedMessage (never anything else)."""
from __future__ import annotations

import pytest
from hypothesis import assume, given, settings, strategies as st

from tandem.rdma import DestinationDescriptor, ModelSpec, ShardScheme
from tandem.rdma.descriptor import _MAGIC as DESCRIPTOR_MAGIC
from tandem.rdma.wire import (KEY_MASK, KIND_DATA, MAX_OPS, REFUSED_SECRET, Abort, Ack,
                              MalformedMessage, Nack, Open, data_tag, decode_control,
                              encode_control, parse_tag)
from tandem.rdma.wire import _MAGIC as CONTROL_MAGIC


def descriptor(**kw) -> DestinationDescriptor:
    base = dict(worker_address=b"\x01ucx-address\xff", slot=17, generation=123456, num_tokens=50,
                page_ids=tuple(range(40, 44)),
                models=(ModelSpec("target", 4, 8, 64, 16, "bfloat16", "HND"),
                        ModelSpec("draft", 2, 2, 64, 16, "float32", "NHD")),
                src=ShardScheme(2), dst=ShardScheme(4, 2), max_run_pages=8,
                context_nbytes=(4096, 128), seed=99, secret=bytes(range(16)))
    base.update(kw)
    return DestinationDescriptor(**base)


@settings(max_examples=300, deadline=None)
@given(key=st.integers(0, KEY_MASK), op=st.integers(0, MAX_OPS - 1))
def test_data_tags_round_trip(key, op):
    assert parse_tag(data_tag(key, op)) == (KIND_DATA, key, op)


def test_descriptor_round_trip_and_expected_count():
    d = descriptor()
    e = DestinationDescriptor.from_bytes(d.to_bytes())
    assert e == d and e.expected_ops == d.expected_ops > 0


def test_descriptor_rejects_version_skew_in_the_plan():
    raw = bytearray(descriptor().to_bytes())
    # the expected-ops field sits after the fixed header and 9 leading fixed fields
    off = 12 + 4 * 3 + 2 * 4 + 4 + 8
    raw[off] ^= 1
    with pytest.raises(MalformedMessage, match="version skew"):
        DestinationDescriptor.from_bytes(bytes(raw))


@pytest.mark.parametrize("cut", [0, 5, 12, 40, -1])
def test_truncated_descriptor_is_malformed(cut):
    raw = descriptor().to_bytes()
    with pytest.raises(MalformedMessage):
        DestinationDescriptor.from_bytes(raw[:cut] if cut >= 0 else raw + b"\0")


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, 10_000), val=st.integers(0, 255))
def test_corrupted_descriptor_parses_or_is_malformed(pos, val):
    raw = bytearray(descriptor().to_bytes())
    raw[pos % len(raw)] = val
    try:
        DestinationDescriptor.from_bytes(bytes(raw))
    except MalformedMessage:
        pass


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_bytes_are_malformed(data):
    """Bytes that are no frame of ours (no magic) are refused as malformed, never parsed
    and never another exception."""
    for magic, parse in ((DESCRIPTOR_MAGIC, DestinationDescriptor.from_bytes), (CONTROL_MAGIC, decode_control)):
        assume(not data.startswith(magic))
        with pytest.raises(MalformedMessage):
            parse(data)


def test_control_round_trip_and_rejections():
    secret = bytes(range(16))
    for msg in (Open(7, b"addr", 3, 2**32 - 1, secret), Ack(2**63), Nack(5, REFUSED_SECRET, "no"),
                Abort(4, 9, secret, 5)):
        assert decode_control(encode_control(msg)) == msg
    raw = encode_control(Open(1, b"xyz", 0, 1, secret))
    with pytest.raises(MalformedMessage, match="magic"):
        decode_control(b"XXXX" + raw[4:])
    with pytest.raises(MalformedMessage, match="protocol version"):
        decode_control(raw[:4] + b"\x09\x00" + raw[6:])
    with pytest.raises(MalformedMessage, match="length"):
        decode_control(raw + b"\0")
