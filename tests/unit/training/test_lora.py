"""LoRA training (backends/training/lora.py, lora_train.py): the wrapper computes ``W + s B A``
on each targeted slice of the fused projections, writes PEFT's format (keys, shapes, config),
PEFT itself loads that adapter onto the HF model with the same logits (fp32, every tiny
architecture), and a tiny adapter trains end to end through ``train_lora``."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tandem.backends.models import load_model
from tandem.backends.models.llama import forward_dense
from tandem.backends.lora.adapter import module_shapes
from tandem.backends.training.lora import (CONFIG_FILE, WEIGHTS_FILE, LoRAConfig, apply_lora,
                                           load_adapter, lora_modules, peft_key, save_adapter,
                                           set_lora_enabled)

from ..tiny_checkpoints import make_checkpoint

TARGET_SETS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"],
               ["gate_proj", "up_proj", "down_proj"],
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]]
IDS = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 5]])


def randomize(model, seed: int = 1) -> None:
    """Non-zero B (PEFT starts it at zero, which would hide a wrong B)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in lora_modules(model).values():
            for p in list(w.lora_A.values()) + list(w.lora_B.values()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(forward_dense(model, ids))


@pytest.fixture(scope="module")
def base_dir(checkpoint_root):
    return make_checkpoint("llama_gqa_untied", checkpoint_root)


@pytest.mark.parametrize("targets", TARGET_SETS, ids=lambda t: "+".join(t))
def test_the_adapter_file_has_peft_keys_shapes_and_config(base_dir, tmp_path, targets):
    model = load_model(base_dir)
    cfg = LoRAConfig(r=4, lora_alpha=8, target_modules=targets)
    apply_lora(model, cfg)
    save_adapter(model, tmp_path, cfg, "tiny-base")
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    c = model.config
    expected = {}
    for layer in range(c.num_hidden_layers):
        for t in targets:
            fan_in, fan_out = module_shapes(c)[t]
            expected[peft_key(layer, t, "A")] = (4, fan_in)
            expected[peft_key(layer, t, "B")] = (fan_out, 4)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    conf = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM" and conf["bias"] == "none"
    assert (conf["r"], conf["lora_alpha"], conf["base_model_name_or_path"]) == (4, 8, "tiny-base")
    assert sorted(conf["target_modules"]) == sorted(targets)


def test_a_fresh_adapter_is_a_no_op_and_trains_only_a_and_b(base_dir):
    model = load_model(base_dir)
    before = logits(model)
    apply_lora(model, LoRAConfig(r=4, target_modules=TARGET_SETS[-1]))
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


@pytest.mark.parametrize("targets", TARGET_SETS, ids=lambda t: "+".join(t))
def test_the_wrapper_equals_the_merged_weights(base_dir, targets):
    """x W'^T with W' = W + (alpha / r) B A on each targeted slice: what PEFT's merge gives."""
    model = load_model(base_dir)
    merged = load_model(base_dir)
    cfg = LoRAConfig(r=3, lora_alpha=5, target_modules=targets)
    apply_lora(model, cfg)
    randomize(model)
    with torch.no_grad():
        for (i, proj), w in lora_modules(model).items():
            group = getattr(merged.layers[i], "self_attn" if proj in ("qkv_proj", "o_proj") else "mlp")
            weight, start = getattr(group, proj).weight, 0
            for name, size in w.parts:
                if name in w.lora_A:
                    weight[start:start + size] += cfg.scaling * w.lora_B[name] @ w.lora_A[name]
                start += size
    torch.testing.assert_close(logits(model), logits(merged), rtol=1e-4, atol=1e-4)
    set_lora_enabled(model, False)
    torch.testing.assert_close(logits(model), logits(load_model(base_dir)), rtol=0, atol=0)


@pytest.mark.parametrize("targets", [TARGET_SETS[0], TARGET_SETS[-1]], ids=["qv", "all"])
def test_peft_loads_the_adapter_onto_the_hf_model_with_the_same_logits(tiny_checkpoint, tmp_path,
                                                                        targets):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = load_model(tiny_checkpoint)
    cfg = LoRAConfig(r=4, lora_alpha=16, target_modules=targets)
    apply_lora(model, cfg)
    randomize(model)
    save_adapter(model, tmp_path / "adapter", cfg, str(tiny_checkpoint))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(IDS).logits
        merged = peft_model.merge_and_unload()(IDS).logits
    ours = logits(model)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, merged, rtol=1e-4, atol=1e-4)
    assert (ours - logits(load_model(tiny_checkpoint))).abs().max() > 1e-2   # the adapter matters


def test_an_adapter_loads_back_and_a_misfit_is_refused(base_dir, tmp_path):
    model = load_model(base_dir)
    cfg = LoRAConfig(r=2, lora_alpha=4, target_modules=["v_proj", "o_proj"])
    apply_lora(model, cfg)
    randomize(model)
    save_adapter(model, tmp_path / "a", cfg, "tiny-base", torch.bfloat16)
    loaded = load_model(base_dir)
    assert load_adapter(loaded, tmp_path / "a").target_modules == ["v_proj", "o_proj"]
    assert load_file(str(tmp_path / "a" / WEIGHTS_FILE))[peft_key(0, "v_proj", "A")].dtype == torch.bfloat16
    torch.testing.assert_close(logits(loaded), logits(model), rtol=2e-2, atol=2e-2)

    other = make_checkpoint("qwen3", tmp_path)         # head_dim 32: v_proj's width differs
    with pytest.raises(ValueError, match="has shape"):
        load_adapter(load_model(other), tmp_path / "a")
    conf = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps(conf | {"use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        load_adapter(load_model(base_dir), tmp_path / "a")
    with pytest.raises(ValueError, match="allowed: q_proj"):
        LoRAConfig(target_modules=["lm_head"])


def test_a_tiny_adapter_trains_end_to_end(checkpoint_root, tmp_path):
    """train_lora on a hand-made answers.json: the answer loss falls, the adapter and its
    record are written, and the effect is measured with and without it."""
    from tandem.backends.training.lora_data import AnswerRow, save_answers
    from tandem.backends.training.lora_train import LoRATrainConfig, train_lora

    from ..tiny_checkpoints import make_checkpoint_with_tokenizer
    base_dir = make_checkpoint_with_tokenizer(checkpoint_root)
    rows = [AnswerRow(f"q{i}", "t", f"def f{i}(x):\n", f"return x + {i}.") for i in range(24)]
    save_answers({"train": rows[:16], "held_out": rows[16:]}, tmp_path / "data", {"made": "by hand"})
    cfg = LoRATrainConfig.from_dict({"style": "shout", "lora": {"r": 4, "lora_alpha": 8},
                                     "base_dtype": "float32", "eval_prompts": 2,
                                     "eval_new_tokens": 4,
                                     "optim": {"steps": 60, "batch_size": 4, "lr": 2e-2,
                                               "warmup_steps": 2, "eval_every": 30,
                                               "eval_windows": 4, "amp": "none"}})
    record = train_lora(cfg, "tiny-base", base_dir, tmp_path / "data", tmp_path / "work",
                        tmp_path / "out")
    losses = [h["val_loss"] for h in record["history"]]
    assert record["step"] == 60 and losses[-1] < 0.7 * losses[0], losses
    assert set(record["effect"]) >= {"with_adapter", "base"}
    assert load_adapter(load_model(base_dir), tmp_path / "out").r == 4
    assert json.loads((tmp_path / "out" / "training.json").read_text())["style"] == "shout"
