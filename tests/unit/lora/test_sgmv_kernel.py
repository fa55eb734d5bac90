"""The fused CPU LoRA kernel (backends/cpu_kernels/lora_sgmv.cpp) against the segmented
torch deltas, on the pool's own layout: adapters of mixed ranks and target sets in one
pool (q/k/v and gate/up fused, B block-diagonal), rows of no adapter, a slot whose
adapter leaves a layer alone, widths that are not multiples of 16, part boundaries
inside a 64-column block; fp32 and bf16 activations."""
from __future__ import annotations

import pytest
import torch

from tandem.backends import cpu_kernels
from tandem.backends.lora import batch as lora_batch
from tandem.backends.lora.adapter import LoRAAdapter, module_shapes
from tandem.backends.lora.batch import plan_lora
from tandem.backends.lora.ops import lora_delta_segmented
from tandem.backends.lora.pool import GROUPS, LoRAPool
from tandem.backends.models.config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu_kernels.load("lora"), reason="no C++ compiler for the CPU kernels")

# hidden 40, 5 heads of 8 (q 40), 1 KV head (k, v 8: parts end inside a 64-column block), MLP 72
CFG = ModelConfig("llama", 64, 40, 72, 2, 5, 1, 8)
ADAPTERS = {  # name: (rank, target modules)
    "all-r5": (5, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "qv-r16": (16, ("q_proj", "v_proj")),
    "mlp-r3": (3, ("gate_proj", "up_proj", "down_proj")),
    "o-r1": (1, ("o_proj",)),
}


def random_adapter(name: str, rank: int, targets, seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(CFG)
    weights = {(layer, m): (torch.randn(rank, shapes[m][0], generator=g) / 4,
                            torch.randn(shapes[m][1], rank, generator=g) / 4)
               for layer in range(CFG.num_hidden_layers) for m in targets}
    return LoRAAdapter(name, rank, 2.0, weights)


@pytest.fixture(scope="module")
def pool() -> LoRAPool:
    pool = LoRAPool(CFG, max_loras=5, max_rank=16)      # slot 5 stays empty
    for slot, (name, (rank, targets)) in enumerate(ADAPTERS.items(), 1):
        pool.load(slot, random_adapter(name, rank, targets, slot))
    return pool


LAYOUTS = {
    "decode mix": [1, 0, 2, 3, 1, 4, 0, 2, 3, 4, 1, 0, 2, 2, 3, 1],
    "one row": [3],
    "one adapter's prefill": [2] * 9,
    "a prefill beside decode rows": [3] * 70 + [1, 0, 4],
    "scattered": [4, 1, 4, 0, 1, 4, 2, 0, 4],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_adds_what_the_segmented_deltas_add(pool, layout, dtype):
    slots = LAYOUTS[layout]
    plan = plan_lora(pool, slots, [1] * len(slots))
    assert plan.row_slots is not None
    g = torch.Generator().manual_seed(len(slots))
    for layer in range(CFG.num_hidden_layers):
        for group in GROUPS:
            A, B = pool.weights(layer, group)
            x = torch.randn(len(slots), A.shape[1], generator=g).to(dtype)
            base = torch.randn(len(slots), B.shape[2], generator=g).to(dtype)
            got = plan.apply(layer, group, x, base.clone())
            segments = plan.by_group[group]
            want = base.clone() if segments is None else lora_delta_segmented(x, A, B, segments,
                                                                               out=base.clone())
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:   # the kernel rounds the sum once, the segmented path the delta and then the sum
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            for i, slot in enumerate(slots):
                if slot == 0 or group not in pool.groups(slot):
                    assert torch.equal(got[i], base[i]), (group, i, slot)


def test_attention_output_rows_from_a_strided_view(pool):
    """The o group's input is the attention output reshaped: a non-contiguous x is read
    as the values it holds."""
    slots = LAYOUTS["decode mix"]
    plan = plan_lora(pool, slots, [1] * len(slots))
    A, B = pool.weights(0, "o")
    wide = torch.randn(len(slots), 2 * A.shape[1])
    x = wide[:, ::2]
    got = plan.apply(0, "o", x, torch.zeros(len(slots), B.shape[2]))
    want = lora_delta_segmented(x.contiguous(), A, B, plan.by_group["o"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernels_off_keep_the_segmented_matmuls(pool, monkeypatch):
    assert plan_lora(pool, [1], [300]).row_slots is not None, "a long prefill runs the kernel too"
    monkeypatch.setattr(lora_batch, "fused_kernel", lambda pool: False)
    assert plan_lora(pool, [1], [1]).row_slots is None


@pytest.mark.parametrize("bad,message", [
    (dict(widths=torch.tensor([0, 7, 0, 0, 0, 0], dtype=torch.int32)), "multiple of the 3 parts"),
    (dict(widths=torch.tensor([0, 99, 0, 0, 0, 0], dtype=torch.int32)), "beyond rank"),
    (dict(row_slots=torch.tensor([6], dtype=torch.int32)), "has slot 6 of 6"),
    (dict(part_cols=[0, 40, 48]), "part_cols from 0 to out"),
    (dict(x=torch.zeros(1, 40, dtype=torch.float16)), "fp32 or both bf16"),
])
def test_the_kernel_refuses_what_it_cannot_compute(pool, bad, message):
    A, B = pool.weights(0, "qkv")
    args = dict(y=torch.zeros(1, B.shape[2]), x=torch.zeros(1, A.shape[1]), A=A, B=B,
                row_slots=torch.tensor([1], dtype=torch.int32),
                widths=torch.tensor([0, 15, 0, 0, 0, 0], dtype=torch.int32), part_cols=pool.part_cols["qkv"])
    args.update(bad)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tandem_cpu.lora_sgmv_(*args.values())
