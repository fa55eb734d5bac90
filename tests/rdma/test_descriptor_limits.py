"""A descriptor is hostile until checked: parsing bounds every count and sizes the plan
in closed form before any plan exists, and the decoder holds it against its pool.
What is refused is refused with MalformedMessage, saying why; what passes plans to
exactly the operation count the parser computed."""
from __future__ import annotations

import dataclasses
import struct

import pytest

from tandem.rdma import DestinationDescriptor, ModelSpec, PoolSpec, ShardScheme
from tandem.rdma.descriptor import LIMITS, check_for_pool
from tandem.rdma.plan import count_ops, num_runs, page_runs, plan_transfer
from tandem.rdma.wire import MalformedMessage

SECRET = bytes(range(16))
TARGET = ModelSpec("target", 2, 4, 8, 4, "bfloat16", "HND")


def desc(**kw) -> DestinationDescriptor:
    base = dict(worker_address=b"ucx-address", slot=3, generation=7, num_tokens=10,
                page_ids=(5, 6, 9), models=(TARGET,), src=ShardScheme(1), dst=ShardScheme(1),
                max_run_pages=2, context_nbytes=(64,), seed=1, secret=SECRET)
    base.update(kw)
    return DestinationDescriptor(**base)


def hostile(**kw) -> bytes:
    """Bytes of a descriptor the parser must refuse (built without the parser)."""
    return desc(**kw).to_bytes()


@pytest.mark.parametrize("case,data,why", [
    ("huge page size, NHD split over ranks",
     lambda: hostile(models=(ModelSpec("t", 1, 2, 1, 1 << 16, "uint8", "NHD"),), num_tokens=1,
                     page_ids=(0,), dst=ShardScheme(2)), "pieces per page"),
    ("page size 2^24",
     lambda: hostile(models=(ModelSpec("t", 1, 2, 1, 1 << 24, "uint8", "NHD"),), num_tokens=1,
                     page_ids=(0,), dst=ShardScheme(2)), "pieces per page"),
    ("tensor parallelism beyond the cap",
     lambda: hostile(models=(ModelSpec("t", 1, 128, 8, 4),), dst=ShardScheme(128)), "tp_size"),
    ("layers beyond the cap",
     lambda: hostile(models=(ModelSpec("t", 5000, 4, 8, 4),)), "layers"),
    ("operations per layer beyond the cap",
     lambda: hostile(models=(ModelSpec("t", 1, 64, 8, 16, "bfloat16", "NHD"),), num_tokens=16_000,
                     page_ids=tuple(range(1000)), src=ShardScheme(64)), "operations per layer"),
    ("pages that do not hold the tokens",
     lambda: hostile(num_tokens=100), "tokens do not fill"),
    ("a page listed twice",
     lambda: hostile(page_ids=(5, 5, 9)), "twice"),
])
def test_hostile_descriptors_are_refused_before_any_plan(case, data, why):
    with pytest.raises(MalformedMessage, match=why):
        DestinationDescriptor.from_bytes(data())


def test_a_descriptor_claiming_more_pages_than_it_carries_is_truncated():
    raw = bytearray(desc().to_bytes())
    # n_pages sits after the fixed fields up to n_ctx (12 header bytes + 45)
    off = 12 + struct.calcsize("<IIIHHHHIQQB")
    struct.pack_into("<I", raw, off, LIMITS.max_pages)
    with pytest.raises(MalformedMessage, match="truncated"):
        DestinationDescriptor.from_bytes(bytes(raw))
    struct.pack_into("<I", raw, off, LIMITS.max_pages + 1)
    with pytest.raises(MalformedMessage, match="pages"):
        DestinationDescriptor.from_bytes(bytes(raw))


def test_oversized_bytes_are_refused_unread():
    with pytest.raises(MalformedMessage, match="bytes"):
        DestinationDescriptor.from_bytes(b"\0" * (LIMITS.max_bytes + 1))


def test_the_secret_round_trips_and_is_never_printed():
    d = DestinationDescriptor.from_bytes(desc().to_bytes())
    assert d.secret == SECRET and d.proves(SECRET) and not d.proves(bytes(16))
    assert SECRET.hex() not in repr(d) and str(list(SECRET)) not in repr(d)


SCHEMES = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (4, 1)),
           ((4, 2), (2, 1)), ((2, 2), (4, 4))]


@pytest.mark.parametrize("src,dst", SCHEMES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_ids,max_run", [((4, 5, 6, 9, 10, 2), 2), ((7,), 1),
                                              (tuple(range(20, 37)), 16)])
def test_the_closed_form_count_is_the_plans(src, dst, layout, page_ids, max_run):
    models = (ModelSpec("target", 3, 8, 16, 4, "bfloat16", layout),
              ModelSpec("draft", 1, 4, 8, 4, "float32", layout))
    src, dst = ShardScheme(*src), ShardScheme(*dst)
    plan = plan_transfer(models, page_ids, 4 * len(page_ids) - 1, src, dst, max_run, (32, 8), 5)
    total, widest = count_ops(models, page_ids, src, dst, max_run, 2, 5)
    assert total == plan.num_ops
    assert widest == max(len(lo) for lo in plan.layer_ops)
    assert num_runs(page_ids, max_run) == len(page_runs(page_ids, max_run))


POOL = PoolSpec("unused", (TARGET,), num_pages=16, num_slots=8, context_bytes=64)


@pytest.mark.parametrize("change,why", [
    (dict(slot=8), "slot 8 out of range"),
    (dict(page_ids=(5, 6, 16)), "page id 16 out of range"),
    (dict(models=(dataclasses.replace(TARGET, num_layers=3),)), "models"),
    (dict(dst=ShardScheme(2)), "sharding"),
    (dict(context_nbytes=(65,)), "context"),
])
def test_the_decoder_holds_a_descriptor_against_its_pool(change, why):
    check_for_pool(desc(), POOL)
    with pytest.raises(MalformedMessage, match=why):
        check_for_pool(DestinationDescriptor.from_bytes(desc(**change).to_bytes()), POOL)
