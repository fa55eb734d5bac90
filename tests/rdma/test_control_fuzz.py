"""Malformed UCX messages against a live receiver (kv_transfer's, in its own process):
500 generated messages on the control tag and on data tags — random bytes, truncated and
bit-flipped control messages, unknown kinds, wrong protocol versions, lying length
fields, messages a receiver never expects (Ack, Nack), Opens and give-ups (Abort) naming
reservations that do not exist or with a wrong secret, oversized ones, data under random and real
keys — while a reservation waits for its KV. Nothing crashes: the receiver answers, its
counters account for what it dropped or refused, the waiting reservation is untouched
and then filled exactly by a real sender, and every page and slot comes back."""
from __future__ import annotations

import random
import struct

import numpy as np

from tandem.rdma import DestinationDescriptor, ModelSpec
from tandem.rdma.shared_pool import READY, RESERVED
from tandem.rdma.wire import (ABORT, ACK, MAX_CONTROL_BYTES, NACK, OPEN, Abort, Ack, Nack, Open, _MAGIC,
                              control_tag, encode_control, frame)

from .peers import data_tag, expected_dst_page, full_kv

SPEC = ModelSpec("target", 4, 2, 8, 4, "float32", "HND")
SRC_PAGES = 16
MESSAGES = 500


def counters(pool):
    s = pool.stats()
    return s.free, s.reserved, s.in_use, s.slots_active


def hostile_messages(rng: random.Random, victim: DestinationDescriptor, reply: bytes) -> list[tuple[int, bytes]]:
    """``(tag, bytes)`` pairs, each wrong in its own way (none opens ``victim``)."""
    def rand_bytes(lo=0, hi=300):
        return rng.randbytes(rng.randint(lo, hi))

    valid = [encode_control(Open(rng.getrandbits(64), reply, victim.slot, victim.generation, rng.randbytes(16))),
             encode_control(Ack(7)), encode_control(Nack(7, 1, "no")),
             encode_control(Abort(victim.slot, victim.generation, rng.randbytes(16), 7))]   # a forged give-up
    makers = [
        lambda: rand_bytes(),                                                      # noise
        lambda: (m := rng.choice(valid))[:rng.randrange(len(m))],                  # truncated
        lambda: _flip(rng, rng.choice(valid)),                                     # a bit flipped
        lambda: frame(_MAGIC, rng.choice([0, 5, 99, 65535]), rand_bytes(0, 64)),   # unknown kind
        lambda: struct.pack("<4sHHI", _MAGIC, rng.randint(2, 9), OPEN, 4) + b"abcd",   # other version
        lambda: struct.pack("<4sHHI", _MAGIC, 1, OPEN, rng.getrandbits(32)) + rand_bytes(0, 40),  # lying length
        lambda: frame(_MAGIC, OPEN, struct.pack("<QII16sI", 1, victim.slot, victim.generation,
                                                rng.randbytes(16), 1 << 30)),      # address length past the end
        lambda: rng.choice(valid[1:]),                                             # unexpected kinds
        lambda: encode_control(Open(1, reply, rng.randint(0, 1 << 31), rng.randint(0, 1 << 31),
                                    rng.randbytes(16))),                           # no such reservation
        lambda: valid[0],                                                          # the victim, a wrong secret
        lambda: rng.randbytes(MAX_CONTROL_BYTES + rng.randint(1, 4096)),           # oversized
        lambda: frame(_MAGIC, rng.choice([ACK, NACK, ABORT]), rand_bytes(0, 30)),  # known kinds, bad payloads
    ]
    out = []
    for _ in range(MESSAGES):
        if rng.random() < 0.2:   # data: a random key, or the victim's before any Open, any size
            key = victim.tag_key if rng.random() < 0.5 else rng.getrandbits(32)
            out.append((data_tag(key, rng.randrange(64)), rand_bytes(1, 5000)))
        else:
            out.append((control_tag(), rng.choice(makers)()))
    return out


def _flip(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def test_hostile_messages_leave_the_receiver_serving_and_nothing_leaked(make_pool, rx, tx0, tx1):
    pool = make_pool([SPEC], num_pages=32, fail_grace_s=0.0)
    start = counters(pool)
    address = rx("rx_start", pool.spec.name)
    before = rx("rx_stats")
    victim = DestinationDescriptor.from_bytes(rx("rx_reserve", 30, max_run_pages=1, timeout_s=120))
    reply = tx1("raw_start")
    sent = tx1("raw_send", address, hostile_messages(random.Random(11), victim, reply), wait_s=60)
    assert sent.count("ok") == MESSAGES, {s for s in sent if s != "ok"}
    after = rx("rx_stats")                      # it answers: the receiver lives
    dropped = sum(after[k] - before[k] for k in ("dropped_malformed", "dropped_unopened", "dropped_stale",
                                                  "refused"))
    assert dropped > 0 and after["handshakes"] == before["handshakes"]
    st = pool.poll(victim.slot, victim.generation)
    assert st.state == RESERVED and st.completed == 0          # untouched
    # a real sender still fills it, exactly
    tx0("tx_start", [SPEC], SRC_PAGES, rank=0, seed=5)
    src_pages = [3, 1, 4, 1, 5, 9, 2, 6]
    [res] = tx0("tx_run", [(victim.to_bytes(), src_pages)], wait_s=30, context=False)
    assert res["error"] is None, res
    assert rx("rx_wait", victim.slot, victim.generation)[0] == READY
    pages = pool.claim(victim.slot, victim.generation, victim.secret)
    full = full_kv(SPEC, SRC_PAGES, 5)
    got = pool.kv(0, "target").reshape(SPEC.num_layers, 32, -1)
    for k, page in enumerate(pages):
        np.testing.assert_array_equal(got[:, page], expected_dst_page(full, "HND", src_pages[k], (0, 2)))
    pool.free(pages)
    tx1("reset")
    assert counters(pool) == start
