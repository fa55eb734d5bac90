"""Tiny random HF checkpoints, created with transformers and saved locally, for parity tests."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=384, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, initializer_range=0.05)


def _configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    return {
        "llama_gqa_untied": LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama3_rope_tied": LlamaConfig(**COMMON, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    }


ARCHS = ("llama_gqa_untied", "llama3_rope_tied", "qwen2", "qwen3")


def make_checkpoint(name: str, root: Path, seed: int = 0) -> Path:
    """Save a random model of the named architecture under root/name; return the dir."""
    from transformers import AutoModelForCausalLM
    out = root / name
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[name])
    if getattr(model.config, "attention_bias", False) or name == "qwen2":
        with torch.no_grad():  # non-zero biases, so a dropped bias would show
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    with torch.no_grad():  # a stronger residual stream, so tied models do not just echo
        for layer in model.model.layers if model.config.tie_word_embeddings else []:
            layer.self_attn.o_proj.weight.mul_(6)
            layer.mlp.down_proj.weight.mul_(6)
    model.save_pretrained(out)
    return out


def make_tokenizer(out: Path, vocab_size: int = 384) -> Path:
    """A byte-level BPE tokenizer.json trained on this file's own source."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([Path(__file__).read_text()] * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    return out


def make_checkpoint_with_tokenizer(root: Path) -> Path:
    out = make_checkpoint("llama_gqa_untied", root / "with_tokenizer")
    if not (out / "tokenizer.json").exists():
        make_tokenizer(out)
    return out
