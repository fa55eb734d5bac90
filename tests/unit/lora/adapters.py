"""Tiny random PEFT LoRA adapters for the tests, made with PEFT itself, and the HF
reference with PEFT's merged weights."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGET_SETS = {"attention": ATTENTION, "mlp": MLP, "all": ATTENTION + MLP}


def make_adapter(base_dir: Path, out: Path, targets=ATTENTION + MLP, r: int = 4, alpha: float = 8,
                 use_rslora: bool = False, seed: int = 0, std: float = 0.2, **options) -> Path:
    """A PEFT adapter of ``base_dir`` saved under ``out``, with random A and B (PEFT
    starts B at zero, which would make every adapter the base model)."""
    if (out / "adapter_config.json").exists():
        return out
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                            use_rslora=use_rslora, lora_dropout=0.0, **options))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    peft.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=None)
def merged_greedy(base_dir: str, adapter_dir: str | None, prompts: tuple[tuple[int, ...], ...],
                  max_new_tokens: int) -> tuple[tuple[int, ...], ...]:
    """HF transformers' greedy tokens (fp32) with the adapter merged by PEFT (None: the base)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    model.generation_config.eos_token_id = None     # the engine runs with ignore_eos
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(tuple(gen[0, len(p):].tolist()))
    return tuple(outs)
