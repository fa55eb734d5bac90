"""The batched LoRA delta (gathered and segmented) against the row-by-row definition:
ranks 1..16 mixed in one pool (padded to the largest), empty slots, rows of one adapter
contiguous or scattered, rows with no adapter."""
from __future__ import annotations

import pytest
import torch

from tandem.backends.lora.ops import (lora_delta_gathered, lora_delta_reference,
                                      lora_delta_segmented, lora_segments)


def make_slots(ranks: list[int], fan_in: int, fan_out: int, max_rank: int, seed: int = 0):
    """A/B stacks with slot 0 empty and slot i+1 holding a rank ranks[i] adapter (0: an
    empty slot), padded to max_rank with zeros, as the pool holds them; and scales."""
    g = torch.Generator().manual_seed(seed)
    A = torch.zeros(len(ranks) + 1, fan_in, max_rank)
    B = torch.zeros(len(ranks) + 1, max_rank, fan_out)
    for s, r in enumerate(ranks, 1):
        A[s, :, :r] = torch.randn(fan_in, r, generator=g)
        B[s, :r] = torch.randn(r, fan_out, generator=g)
    scales = torch.rand(len(ranks) + 1, generator=g) + 0.5
    return A, B, scales


LAYOUTS = {
    "one row": [1],
    "base only": [0, 0, 0],
    "decode mix": [1, 0, 2, 3, 1, 4, 0, 2],
    "prefill runs": [2] * 7 + [0] * 5 + [4] * 9 + [1] * 3,
    "scattered": [3, 1, 3, 0, 1, 3, 5, 5, 0, 3],
    "empty slot only": [5, 5],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fan_in,fan_out", [(16, 24), (64, 160)])
@pytest.mark.parametrize("scaled", [False, True])
def test_batched_deltas_match_rows_one_by_one(layout, fan_in, fan_out, scaled):
    ranks = [1, 4, 16, 7, 0]            # slot 5 is empty: loaded with nothing yet
    A, B, scales = make_slots(ranks, fan_in, fan_out, max_rank=16)
    slots = LAYOUTS[layout]
    x = torch.randn(len(slots), fan_in, generator=torch.Generator().manual_seed(2))
    idx = torch.tensor(slots)
    s = scales if scaled else None
    want = lora_delta_reference(x, A, B, idx, s)
    # fp32 sums in another order (BLAS picks its blocking by shape and threads): ~1e-5 off at
    # values ~3, where a wrong slot or scale is off by O(1)
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lora_delta_gathered(x, A, B, idx, s), want, **tol)
    torch.testing.assert_close(lora_delta_segmented(x, A, B, lora_segments(slots), s), want, **tol)
    # rows of slot 0 and of the empty slot get nothing
    for i, slot in enumerate(slots):
        if slot in (0, 5):
            assert not want[i].any()


def test_segmented_adds_into_the_base_output():
    A, B, _ = make_slots([3, 5], 8, 6, max_rank=8)
    slots = [0, 2, 1, 2]
    x, base = torch.randn(4, 8), torch.randn(4, 6)
    out = lora_delta_segmented(x, A, B, lora_segments(slots), out=base.clone())
    torch.testing.assert_close(out, base + lora_delta_reference(x, A, B, torch.tensor(slots)))


def test_padding_past_an_adapters_rank_adds_nothing():
    A, B, _ = make_slots([4], 8, 6, max_rank=4)
    wide_A, wide_B = torch.zeros(2, 8, 16), torch.zeros(2, 16, 6)
    wide_A[:, :, :4], wide_B[:, :4] = A, B
    wide_A[1, :, 4:] = 1.0      # A's padding meets B's zero rows
    x = torch.randn(3, 8)
    torch.testing.assert_close(lora_delta_segmented(x, wide_A, wide_B, lora_segments([1, 1, 1])),
                               lora_delta_reference(x, A, B, torch.tensor([1, 1, 1])))


def test_segments_group_rows_by_slot_and_copy_nothing_when_in_order():
    segs = lora_segments([0, 2, 2, 1, 2, 0])
    assert segs.rows.tolist() == [3, 1, 2, 4]
    assert segs.groups == [(1, slice(0, 1)), (2, slice(1, 4))]
    assert lora_segments([0, 3, 3, 3, 5, 0]).rows == slice(1, 5)
    assert lora_segments([0, 0]) is None


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_bf16_model_gets_the_delta_of_its_inputs_in_the_pools_dtype(compute):
    A, B, _ = make_slots([3, 5], 16, 12, max_rank=8)
    A, B = A.to(compute), B.to(compute)
    x, y = torch.randn(5, 16).bfloat16(), torch.randn(5, 12).bfloat16()
    slots = [2, 0, 1, 2, 1]
    got = lora_delta_segmented(x, A, B, lora_segments(slots), out=y.clone())
    assert got.dtype == torch.bfloat16
    want = y.float() + lora_delta_reference(x.to(compute).float(), A.float(), B.float(), torch.tensor(slots))
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def test_each_slot_computes_over_its_own_rank_only():
    """A slot's ``width`` bounds the columns it reads: what lies past it is never used."""
    ranks = [2, 5, 8]
    A, B, _ = make_slots(ranks, 12, 10, max_rank=8)
    slots = [3, 1, 0, 2, 1, 3]
    x = torch.randn(6, 12)
    want = lora_delta_reference(x, A, B, torch.tensor(slots))
    A[1, :, 2:], B[2, 5:] = 7.0, 7.0          # junk past slot 1's and slot 2's ranks
    segs = lora_segments(slots)
    segs.widths = {1: 2, 2: 5, 3: 8}
    torch.testing.assert_close(lora_delta_segmented(x, A, B, segs), want)
