"""Model configuration read from a Hugging Face ``config.json``.

Covers the Llama family as one architecture: Llama 2/3 (GQA, llama3 rope
scaling, tied or untied embeddings), Qwen2/2.5 (qkv bias) and Qwen3 (q/k RMSNorm).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}   # the weight/KV dtypes served
DTYPES = tuple(DTYPE_BYTES)
DTYPE_CHOICES = ("auto", *DTYPES)   # what users may ask for: "auto" resolves per device (dtype.py)


@dataclass(slots=True, frozen=True)
class RopeScaling:
    rope_type: str = "default"          # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False              # Qwen2 (and Llama's attention_bias)
    o_bias: bool = False
    qk_norm: bool = False               # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} is not supported; "
                f"allowed: {', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        # transformers 5 moves rope settings into "rope_parameters"
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"config.json: rope_type {rope_type!r} is not supported; "
                             "allowed: default, llama3, linear")
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)),
        )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model_dir: no config.json in {model_dir}")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: invalid config ({e!r})") from e
