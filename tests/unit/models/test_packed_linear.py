"""oneDNN-packed bf16 linear layers (and the small-M kernel's copy): same outputs, same
parameters, only where supported."""
import pytest
import torch
from torch import nn

from tandem.backends import cpu_kernels
from tandem.backends.models import LlamaForCausalLM, ModelConfig, pack_linears
from tandem.backends.models.packed_linear import SMALL_M as SMALL_M_ROWS
from tandem.backends.models.packed_linear import PackedLinear, packing_supported, small_m_packing

SUPPORTED = packing_supported(torch.empty(1, dtype=torch.bfloat16))
needs_packing = pytest.mark.skipif(not SUPPORTED, reason="this CPU has no oneDNN bf16 support")


def tiny_model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_output_is_bit_identical(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias).to(torch.bfloat16).requires_grad_(False)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), linear(x))
        assert torch.equal(packed(x.view(1, rows, 48)), linear(x).view(1, rows, 80))


@needs_packing
@pytest.mark.parametrize("tied", [False, True])
def test_pack_linears_keeps_parameters_ties_and_outputs(tied):
    model = tiny_model(tied)
    keys = list(model.state_dict())
    ids = torch.tensor([3, 5, 7, 9])
    with torch.inference_mode():
        before = model.compute_logits(model.embed_tokens(ids))
        assert pack_linears(model) == 2 * 4 + 1           # qkv, o, gate_up, down per layer; lm_head
        assert pack_linears(model) == 0                   # idempotent
        after = model.compute_logits(model.embed_tokens(ids))
    assert isinstance(model.lm_head, PackedLinear)
    assert list(model.state_dict()) == keys
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert torch.equal(before, after)


def test_nothing_is_packed_in_float32_or_when_switched_off(monkeypatch):
    model = tiny_model(False).float()
    assert pack_linears(model) == 0
    monkeypatch.setenv("TANDEM_PACKED_WEIGHTS", "0")
    assert pack_linears(tiny_model(False)) == 0


@needs_packing
def test_training_still_differentiates_through_the_original_weight():
    linear = nn.Linear(16, 8).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    packed(x).sum().backward()
    assert linear.weight.grad is not None and x.grad is not None


SMALL_M = SUPPORTED and cpu_kernels.load("linear")
needs_small_m = pytest.mark.skipif(not SMALL_M, reason="this CPU has no AVX512-BF16 (or no C++ compiler)")


@needs_small_m
@pytest.mark.parametrize("bias", [False, True])
def test_up_to_eight_rows_go_to_the_small_m_kernel_with_onednn_accuracy(bias):
    """The decode step's shapes (576 in, 960 out): rows 1..8 on the small-M kernel, more
    on oneDNN; both within bf16 rounding of the float product."""
    torch.manual_seed(1)
    linear = nn.Linear(576, 960, bias=bias).to(torch.bfloat16).requires_grad_(False)
    packed = PackedLinear(linear)
    assert packed._small_m is not None
    for rows in (0, 1, 2, 3, 4, 8, 9):   # 0: a prefill chunk that needs no logits
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        with torch.inference_mode():
            out = packed(x)
        exact = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
        # one bf16 rounding of the output (2^-8 relative) plus float summation order
        torch.testing.assert_close(out.float(), exact, rtol=2 ** -7, atol=1e-3)
        if 0 < rows <= SMALL_M_ROWS:
            assert torch.equal(out, torch.ops.tandem_cpu.small_m_linear(x, packed._small_m, linear.bias))
        else:
            assert torch.equal(out, linear(x))   # oneDNN, as F.linear


def test_the_small_m_copy_is_made_only_for_shapes_the_kernel_takes():
    assert small_m_packing(torch.zeros(81, 64, dtype=torch.bfloat16)) is None   # 81 outputs: not 16 | N
    assert small_m_packing(torch.zeros(80, 63, dtype=torch.bfloat16)) is None   # odd K
