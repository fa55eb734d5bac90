"""The LoRA adapters shipped for SmolLM2-135M-Instruct (checkpoints/smollm2/lora-*): PEFT's
files with the shapes their config declares for that model, a training record that measured
the adapter's effect, and checkpoints/ within its 40 MB budget."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from safetensors.torch import load_file

from tandem.backends.lora.adapter import load_adapter, module_shapes
from tandem.backends.models.config import ModelConfig
from tandem.backends.training.lora import CONFIG_FILE, WEIGHTS_FILE, peft_key

CHECKPOINTS = Path(__file__).resolve().parents[3] / "checkpoints"
ADAPTERS = sorted((CHECKPOINTS / "smollm2").glob("lora-*"))
BUDGET_BYTES = 40_000_000           # the budget checkpoints/smollm2/README.md states (du -sb)
# SmolLM2-135M-Instruct (docs/DESIGN's real default model), without converting its GGUF
SMOLLM2 = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def test_adapters_are_shipped():
    assert {a.name for a in ADAPTERS} >= {"lora-shout", "lora-json-answer"}


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda p: p.name)
def test_a_shipped_adapter_loads_with_the_declared_shapes(adapter):
    """Every layer has A [r, in] and B [out, r] of each declared target, and the engine's
    loader takes it for the model."""
    conf = json.loads((adapter / CONFIG_FILE).read_text())
    assert conf["base_model_name_or_path"] == "smollm2-135m-instruct"
    r, shapes = conf["r"], module_shapes(SMOLLM2)
    expected = {}
    for layer in range(SMOLLM2.num_hidden_layers):
        for t in conf["target_modules"]:
            fan_in, fan_out = shapes[t]
            expected[peft_key(layer, t, "A")] = (r, fan_in)
            expected[peft_key(layer, t, "B")] = (fan_out, r)
    tensors = load_file(str(adapter / WEIGHTS_FILE))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.abs().sum() > 0 for k, v in tensors.items() if "lora_B" in k)   # trained
    loaded = load_adapter(adapter.name, adapter, SMOLLM2, max_rank=16)
    assert loaded.rank == r and loaded.scaling == conf["lora_alpha"] / r


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda p: p.name)
def test_a_shipped_adapter_has_its_training_record(adapter):
    record = json.loads((adapter / "training.json").read_text())
    assert record["style"] == adapter.name.removeprefix("lora-")
    assert record["command"].startswith("tandem train lora ")
    assert record["step"] == record["steps_planned"]
    effect = record["effect"]
    assert effect["with_adapter"]["in_style"] > effect["base"]["in_style"]
    assert (adapter / WEIGHTS_FILE).stat().st_size < 600_000


def test_checkpoints_stay_within_their_budget():
    size = sum(p.stat().st_size for p in CHECKPOINTS.rglob("*") if p.is_file())
    assert size <= BUDGET_BYTES, f"checkpoints/ holds {size:,} bytes; the budget is {BUDGET_BYTES:,}"
