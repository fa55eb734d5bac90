"""Load a Llama-family model from a local Hugging Face checkpoint directory."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import DTYPES, ModelConfig
from .llama import LlamaForCausalLM

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    return TORCH_DTYPES[dtype]


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_dir: no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: corrupt or unreadable safetensors file ({e})") from e
    return tensors


def hf_to_tandem(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF keys to this module tree and fuse q/k/v and gate/up projections."""
    sd = {k.removeprefix("model."): v for k, v in hf.items()}
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [sd.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
            if all(t is not None for t in parts):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, 0)
            elif any(t is not None for t in parts):
                raise ValueError(f"checkpoint: incomplete q/k/v {kind} in layer {i}")
        gate, up = sd.pop(f"{p}mlp.gate_proj.weight", None), sd.pop(f"{p}mlp.up_proj.weight", None)
        if gate is not None and up is not None:
            out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([gate, up], 0)
    out.update(sd)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build and load the model; errors name the file and what is wrong.

    >>> model = load_model("checkpoints/demo/target", dtype="bfloat16")  # doctest: +SKIP
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model_dir: {model_dir} is not a directory")
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = parse_dtype(dtype)
    state = hf_to_tandem(read_safetensors(model_dir), cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if "rotary_emb" not in k)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: checkpoint does not match config.json "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise ValueError(f"{model_dir}: {k} has shape {tuple(state[k].shape)}, "
                             f"config.json implies {tuple(shape)}")
    state = {k: state[k].to(device=device, dtype=torch_dtype) for k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)
